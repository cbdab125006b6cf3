"""Images of coloured squares to count, drawn locally with PIL: data for vision-language tests.

:func:`write_counting_rows` writes PNG files and a JSON Lines file of SFT conversations (a user
turn with the image and the question, the assistant's answer: the count) or of prompts for
GRPO (the count the answer the ``math`` environment checks); :func:`write_counting_example`
writes the model and data of the counting example. The same arguments
give the same files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

#: Colours a row's squares may have (one colour per image).
COLOURS = ("red", "blue", "green")
#: Image widths and heights drawn from, in pixels: whole merged patches of 28.
SIDES = (56, 84)
#: Side of a square, in pixels: one vision patch, so a square fills the patch it is drawn on.
SQUARE = 14
QUESTION = "How many {colour} squares are there?"


def draw_squares(rng: random.Random, count: int, colour: str, sides: Sequence[int] = SIDES) -> object:
    """A white PIL image (width and height drawn from ``sides``) with ``count`` squares of
    ``colour``, each filling a different patch."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (rng.choice(sides), rng.choice(sides)), "white")
    draw = ImageDraw.Draw(image)
    cells = [(x, y) for x in range(0, image.width, SQUARE) for y in range(0, image.height, SQUARE)]
    for x, y in rng.sample(cells, count):
        draw.rectangle([x, y, x + SQUARE - 1, y + SQUARE - 1], fill=colour)
    return image


def write_counting_rows(
    folder: str | Path, rows: int, *, seed: int = 0, max_count: int = 4, prompts: bool = False, text_rows: int = 0,
    name: str | None = None, sides: Sequence[int] = SIDES, colours: Sequence[str] = COLOURS,
) -> Path:
    """Write ``rows`` SFT rows (image paths relative to the file) and their images
    (``images/<n>.png``) under ``folder``; return the JSON Lines file, ``name`` or
    ``train.jsonl``. With ``prompts``: prompt rows instead (default name ``prompts.jsonl``),
    the count as the ``answer`` for the ``math`` environment. The last ``text_rows`` rows ask
    their question without the image. Images are ``sides`` wide and high, squares of ``colours``."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for n in range(rows):
        count, colour = rng.randint(1, max_count), rng.choice(colours)
        draw_squares(rng, count, colour, sides).save(folder / "images" / f"{n}.png")
        user = [{"type": "image", "image": f"images/{n}.png"}, {"type": "text", "text": QUESTION.format(colour=colour)}]
        if n >= rows - text_rows:
            user = user[1:]
        if prompts:
            lines.append(json.dumps({"messages": [{"role": "user", "content": user}], "answer": count, "task": "math"}))
        else:
            lines.append(json.dumps({"messages": [{"role": "user", "content": user},
                                                  {"role": "assistant", "content": str(count)}]}))
    path = folder / (name or ("prompts.jsonl" if prompts else "train.jsonl"))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


#: The counting example's images: 56 pixels square (4 image tokens of 2 x 2 patches), red squares, which
#: the tiny model learns to count within a few hundred SFT steps.
EXAMPLE_SIDES = (56,)
EXAMPLE_COLOURS = ("red",)
#: The counting example's files under its root -> rows, seed (each file's images in a folder beside it).
EXAMPLE_FILES = {"sft/train/train.jsonl": (512, 1), "sft/val/val.jsonl": (64, 2),
                 "grpo/prompts/prompts.jsonl": (512, 3), "grpo/val/val.jsonl": (256, 4)}


def write_counting_example(root: str | Path = "runs/vlm_counting") -> Path:
    """What ``examples/configs/vlm_counting_*.yaml`` train on, under ``root``: ``model/``, a
    seeded random tiny Qwen2-VL (:func:`posttrain.testing.zoo.build_zoo_vlm`), and the SFT
    conversations and GRPO prompts of :data:`EXAMPLE_FILES`. Returns ``root``."""
    from posttrain.testing.zoo import build_zoo_vlm

    root = Path(root)
    build_zoo_vlm(root / "model", "qwen2_vl", seed=0)
    for file, (rows, seed) in EXAMPLE_FILES.items():
        path = root / file
        write_counting_rows(path.parent, rows, seed=seed, prompts=file.startswith("grpo"), name=path.name,
                            sides=EXAMPLE_SIDES, colours=EXAMPLE_COLOURS)
    return root
