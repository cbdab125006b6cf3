"""Images in conversations, for vision-language models.

A message's ``content`` may be a list of parts, the layout transformers' chat templates read:
``{"type": "text", "text": ...}`` and ``{"type": "image", "image": <reference>}``. A
reference is a file path (a relative one is read from the data file's folder), the file's
bytes, a Hugging Face datasets ``Image`` value (``{"bytes": ..., "path": ...}``) or a PIL
image. A part ``{"type": "image"}`` without one takes the next entry of the row's ``images``
column (TRL's layout). Nothing is downloaded: a URL is refused.

The chat template writes one placeholder token per image (Qwen-VL's ``<|image_pad|>``); the
model's image processor resizes each image into a grid of ``t x h x w`` patches, and the vision
tower gives one feature per ``merge_size x merge_size`` patches, so the placeholder is widened
to that many tokens. Those tokens are never loss tokens. A dataset keeps each image as its
encoded bytes; :meth:`ImageInputs.model_inputs` makes pixel values when a batch is collated.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.data.formats import Message, RowError
from posttrain.errors import ConfigError

#: Batch fields of image rows: per sample, a [patches, features] float tensor and an
#: [images, 3] int64 tensor of (t, h, w) patch grids (both with 0 rows for a text-only
#: sample). A batch holds them as lists, or stacked and padded (a data plane's round trip
#: stacks per-sample tensors): a padded grid row is all zeros.
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


def sample_images(fields: Mapping[str, Any], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``'s pixel values [patches, features] and patch grids [images, 3] from the
    :data:`IMAGE_FIELDS` of ``fields`` (a batch), listed or stacked: the grids' nonzero rows
    are the images, whose patches lead the pixel rows."""
    grid = fields["image_grid_thw"][i]
    grid = grid[grid.prod(-1) > 0]
    return fields["pixel_values"][i][: int(grid.prod(-1).sum())], grid


def image_parts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The image parts of ``messages``' contents, in order."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") == "image"]


def message_texts(message: Message) -> list[str]:
    """The text of a message: its content, or the text parts of a content list."""
    content = message.get("content")
    if isinstance(content, list):
        return [part["text"] for part in content if part.get("type") == "text"]
    return [content] if isinstance(content, str) else []


def image_references(messages: Sequence[Message], images: Sequence[Any] | None) -> list[Any]:
    """Each image part's reference, in order: its own ``image`` (or ``path``), else the next
    of ``images`` (the row's ``images`` column). A count that does not match is a :class:`RowError`."""
    parts = image_parts(messages)
    pool = list(images or [])
    inline = [part.get("image", part.get("path")) for part in parts]
    bare = sum(ref is None for ref in inline)
    if pool and bare != len(pool):
        raise RowError(
            f"the row's 'images' column holds {len(pool)} images, but its messages have {bare} image parts "
            "without an image of their own to take them; give every image a {'type': 'image'} part, in order"
        )
    if bare and not pool:
        raise RowError(
            f"{bare} of the messages' image parts name no image (no 'image' key) and the row has no 'images' "
            "column; give each part its image ({'type': 'image', 'image': 'cat.png'}) or add an 'images' list"
        )
    taken = iter(pool)
    return [ref if ref is not None else next(taken) for ref in inline]


def read_image(reference: Any, folder: str | None) -> bytes:
    """The encoded bytes of the image ``reference`` names (see the module docstring), checked
    to decode; a relative path is read from ``folder``. A :class:`RowError` says which file
    and why when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(reference, Image.Image):
        out = io.BytesIO()
        reference.save(out, format="PNG")
        return out.getvalue()
    where = "the image bytes"
    if isinstance(reference, Mapping):
        data, path = reference.get("bytes"), reference.get("path")
        if data is None and path is None:
            raise RowError(f"an image value must hold 'bytes' or 'path', found keys {sorted(reference)}")
        reference = data if data is not None else path
    if isinstance(reference, str):
        if "://" in reference:
            raise RowError(f"image '{reference}' is a URL; nothing is downloaded: save the file and give its path")
        path = Path(reference)
        if not path.is_absolute() and folder is not None:
            path = Path(folder) / path
        where = f"image file '{path}'"
        try:
            reference = path.read_bytes()
        except OSError as exc:
            raise RowError(f"cannot read {where}: {exc.strerror or exc}") from None
    if not isinstance(reference, (bytes, bytearray)):
        raise RowError(f"an image must be a path, bytes or an image value, found {type(reference).__name__}")
    try:
        with Image.open(io.BytesIO(reference)) as image:
            image.verify()
    except UnidentifiedImageError:
        raise RowError(f"{where} is not an image PIL can read") from None
    except (OSError, SyntaxError) as exc:  # a damaged file of a known format
        raise RowError(f"{where} is not an image PIL can read ({exc})") from None
    return bytes(reference)


def decode_image(data: bytes) -> Any:
    """A PIL RGB image from encoded bytes."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


class ImageInputs:
    """A vision-language model's image processor and image placeholder: how many tokens an
    image becomes, and its pixel values. :meth:`from_model` reads them from the model folder."""

    def __init__(self, image_processor: Any, placeholder_id: int, placeholder: str):
        self.image_processor = image_processor
        self.placeholder_id = placeholder_id
        self.placeholder = placeholder
        self.merge_size = int(getattr(image_processor, "merge_size", 1) or 1)

    @classmethod
    def from_model(cls, model_path: str, tokenizer: Any) -> ImageInputs | None:
        """The image inputs of the model folder ``model_path``; None for a text-only model. A
        vision-language model whose image processor gives no patch grids (``image_grid_thw``) is
        refused: its image tokens are counted otherwise."""
        from transformers import AutoConfig, AutoImageProcessor

        from posttrain.models.auto import is_vision_language

        file = Path(model_path) / "config.json"
        try:
            if not is_vision_language(json.loads(file.read_text(encoding="utf-8"))):
                return None
        except (OSError, ValueError, AttributeError):
            return None  # the model folder's own checks name what is wrong with it
        config = AutoConfig.from_pretrained(model_path)
        placeholder_id = getattr(config, "image_token_id", None)
        if placeholder_id is None:
            placeholder_id = getattr(config, "image_token_index", None)
        try:
            processor = AutoImageProcessor.from_pretrained(model_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"policy.model: '{model_path}' is a vision-language model ({config.model_type}) but its image "
                f"processor cannot be loaded ({exc}); copy its preprocessor_config.json into the folder"
            ) from None
        if placeholder_id is None or not hasattr(processor, "merge_size"):
            raise ConfigError(
                f"policy.model: '{model_path}' is a {config.model_type} vision-language model; image rows are "
                "read for models whose image processor gives patch grids (image_grid_thw) and whose config names "
                "its image token (image_token_id): Qwen2-VL and Qwen2.5-VL"
            )
        return cls(processor, int(placeholder_id), tokenizer.convert_ids_to_tokens(int(placeholder_id)))

    def grids(self, images: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """The (t, h, w) patch grid of each image."""
        if not images:
            return []
        out = self.image_processor(images=[decode_image(b) for b in images], return_tensors="pt")
        return [tuple(int(v) for v in row) for row in out["image_grid_thw"]]

    def tokens(self, grid: Sequence[int]) -> int:
        """The tokens an image of patch ``grid`` becomes."""
        t, h, w = grid
        return t * h * w // self.merge_size**2

    def widen(self, ids: list[int], mask: list[int], counts: Sequence[int]) -> tuple[list[int], list[int]]:
        """``ids`` with the ``k``-th placeholder repeated ``counts[k]`` times, and ``mask`` with
        0 on every placeholder. A :class:`RowError` when the placeholders are not one per image."""
        found = ids.count(self.placeholder_id)
        if found != len(counts):
            raise RowError(
                f"the row has {len(counts)} images, but the chat template wrote {found} image placeholders "
                f"({self.placeholder}); each image needs one {{'type': 'image'}} part in the messages"
            )
        out_ids: list[int] = []
        out_mask: list[int] = []
        widths = iter(counts)
        for token, m in zip(ids, mask, strict=True):
            n = next(widths) if token == self.placeholder_id else 1
            out_ids += [token] * n
            out_mask += [0 if token == self.placeholder_id else m] * n
        return out_ids, out_mask

    def kept_images(self, ids: Sequence[int], counts: Sequence[int]) -> int:
        """How many whole images the (truncated) ``ids`` hold: the leading images whose every
        token is there."""
        have = list(ids).count(self.placeholder_id)
        kept = total = 0
        for n in counts:
            total += n
            if total > have:
                break
            kept += 1
        return kept

    def model_inputs(self, samples: Sequence[Sequence[bytes]]) -> dict[str, list[torch.Tensor]]:
        """The :data:`IMAGE_FIELDS` of each sample (a list of encoded images)."""
        outputs = [self.image_processor(images=[decode_image(b) for b in images], return_tensors="pt") if images
                   else None for images in samples]
        features = next((out["pixel_values"].shape[1] for out in outputs if out is not None), 0)
        return {
            "pixel_values": [out["pixel_values"].float() if out else torch.zeros(0, features) for out in outputs],
            "image_grid_thw": [out["image_grid_thw"].long() if out else torch.zeros(0, 3, dtype=torch.long)
                               for out in outputs],
        }
