"""Images of coloured squares to count, drawn locally with PIL: data for vision-language tests.

:func:`write_counting_rows` writes PNG files and a JSON Lines file of SFT conversations (a user
turn with the image and the question, the assistant's answer: the count) or of prompts for
GRPO (the count the answer the ``math`` environment checks). The same arguments
give the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

#: Colours a square may have.
COLOURS = ("red", "blue", "green")
#: Image widths and heights drawn from, in pixels (multiples of 28: whole merged patches).
SIDES = (56, 84, 112)
QUESTION = "How many {colour} squares are there?"


def draw_squares(rng: random.Random, count: int, colour: str) -> object:
    """A white PIL image with ``count`` non-overlapping 10-pixel squares of ``colour`` (and
    up to two of another colour)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (rng.choice(SIDES), rng.choice(SIDES)), "white")
    draw = ImageDraw.Draw(image)
    cells = [(x, y) for x in range(0, image.width - 11, 14) for y in range(0, image.height - 11, 14)]
    others = [c for c in COLOURS if c != colour]
    fills = [colour] * count + [rng.choice(others) for _ in range(rng.randint(0, 2))]
    for (x, y), fill in zip(rng.sample(cells, len(fills)), fills, strict=True):
        draw.rectangle([x, y, x + 9, y + 9], fill=fill)
    return image


def write_counting_rows(
    folder: str | Path, rows: int, *, seed: int = 0, max_count: int = 4, prompts: bool = False
) -> Path:
    """Write ``rows`` SFT rows (``train.jsonl``, image paths relative to it) and their images
    (``images/<n>.png``) under ``folder``; return the JSON Lines file. With ``prompts``: prompt
    rows instead (``prompts.jsonl``), the count as the ``answer`` for the ``math`` environment,
    and the last row's question without its image."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for n in range(rows):
        count, colour = rng.randint(1, max_count), rng.choice(COLOURS)
        draw_squares(rng, count, colour).save(folder / "images" / f"{n}.png")
        user = [{"type": "image", "image": f"images/{n}.png"}, {"type": "text", "text": QUESTION.format(colour=colour)}]
        if prompts:
            content = user[1:] if n == rows - 1 else user
            lines.append(json.dumps({"messages": [{"role": "user", "content": content}], "answer": count,
                                     "task": "math"}))
        else:
            lines.append(json.dumps({"messages": [{"role": "user", "content": user},
                                                  {"role": "assistant", "content": str(count)}]}))
    path = folder / ("prompts.jsonl" if prompts else "train.jsonl")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
