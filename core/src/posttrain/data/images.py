"""Images in conversations, for vision-language models.

A message's ``content`` may be a list of parts, the layout transformers' chat templates read:
``{"type": "text", "text": ...}`` and ``{"type": "image", "image": <reference>}``. A
reference is a file path (a relative one is read from the data file's folder), the file's
bytes, a Hugging Face datasets ``Image`` value (``{"bytes": ..., "path": ...}``) or a PIL
image. A part ``{"type": "image"}`` without one takes the next entry of the row's ``images``
column (TRL's layout). Nothing is downloaded: a URL is refused.

The chat template writes one placeholder token per image, which is widened to the image's
tokens (:meth:`ImageInputs.expansion`), never loss tokens, as each family's processor does:

- Qwen-VL (:class:`PatchGridImages`): the image processor resizes an image into a grid of
  ``t x h x w`` patches and the vision tower gives one feature per ``merge_size x merge_size``
  patches, so the placeholder ``<|image_pad|>`` becomes that many of itself;
- Idefics3 / SmolVLM (:class:`TiledImages`): the image processor cuts an image into rows x
  columns tiles and adds the whole image as one more tile; ``<image>`` becomes, per tile,
  ``<fake_token_around_image>``, the tile's tag (``<row_1_col_2>``, ``<global-img>``) and the
  tile's ``image_seq_len`` ``<image>`` tokens.

A dataset keeps each image as its encoded bytes; :meth:`ImageInputs.model_inputs` makes pixel
values when a batch is collated.
"""

from __future__ import annotations

import abc
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.data.formats import Message, RowError
from posttrain.errors import ConfigError

#: Each family's field of per-image grids, an [images, 3] int64 tensor per sample beside its
#: ``pixel_values``: Qwen-VL's (t, h, w) patch grids, whose patches are its pixel rows
#: ([patches, features]); Idefics3's (tiles, rows, columns), whose tiles are its pixel rows
#: ([tiles, 3 x side x side]). Each pixel row belongs to one image, in order.
PIXEL_ROWS = {"image_grid_thw": lambda grids: grids.prod(-1), "image_tiles": lambda grids: grids[:, 0]}
#: Batch fields of image rows: ``pixel_values`` and one family's grids (both with 0 rows for a
#: text-only sample). A batch holds them as lists, or stacked and padded (a data plane's round
#: trip stacks per-sample tensors): a padded grid row is all zeros.
IMAGE_FIELDS = ("pixel_values", *PIXEL_ROWS)


#: A prompt batch's field of each sample's images as encoded files (a list of bytes per sample),
#: for an engine whose own processor reads the images (vLLM).
ENCODED_IMAGES = "image_bytes"


def image_fields(batch: Mapping[str, Any]) -> tuple[str, ...]:
    """The image fields ``batch`` holds: ``pixel_values`` and its family's grids, or none."""
    return next((("pixel_values", name) for name in PIXEL_ROWS if name in batch), ())


def sample_images(fields: Mapping[str, Any], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``'s pixel values and grids [images, 3] from the image fields of ``fields``
    (a batch, :func:`image_fields`), listed or stacked: the grids' nonzero rows are the
    images, whose pixel rows lead its pixel values."""
    (_, name) = image_fields(fields)
    grid = fields[name][i]
    grid = grid[grid.prod(-1) > 0]
    return fields["pixel_values"][i][: int(PIXEL_ROWS[name](grid).sum())], grid


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


class ImageInputs(abc.ABC):
    """A vision-language model's image processor and image placeholder: the tokens an image
    becomes and its pixel values. :meth:`from_model` reads them from the model folder; each
    family is a subclass."""

    #: The model types (``config.json``'s ``model_type``) of this family.
    model_types: tuple[str, ...]
    #: The batch field of this family's per-image grids (:data:`PIXEL_ROWS`).
    grid_field: str

    def __init__(self, processor: Any, placeholder_id: int, placeholder: str):
        self.processor = processor
        self.placeholder_id = placeholder_id
        self.placeholder = placeholder

    @property
    def fields(self) -> tuple[str, str]:
        """The batch fields of this family's images."""
        return "pixel_values", self.grid_field

    @classmethod
    def from_model(cls, model_path: str, tokenizer: Any) -> ImageInputs | None:
        """The image inputs of the model folder ``model_path``; None for a text-only model. A
        vision-language family other than Qwen-VL's and Idefics3's is refused, naming them."""
        from transformers import AutoConfig

        from posttrain.models.auto import is_vision_language

        file = Path(model_path) / "config.json"
        try:
            if not is_vision_language(json.loads(file.read_text(encoding="utf-8"))):
                return None
        except (OSError, ValueError, AttributeError):
            return None  # the model folder's own checks name what is wrong with it
        config = AutoConfig.from_pretrained(model_path)
        family = next((f for f in (PatchGridImages, TiledImages) if config.model_type in f.model_types), None)
        if family is None:
            known = ", ".join(t for f in (PatchGridImages, TiledImages) for t in f.model_types)
            raise ConfigError(
                f"policy.model: '{model_path}' is a {config.model_type} vision-language model; image rows are "
                f"read for the model types {known}"
            )
        try:
            processor = family.load_processor(model_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"policy.model: '{model_path}' is a vision-language model ({config.model_type}) but its image "
                f"processor cannot be loaded ({exc}); copy its preprocessor_config.json into the folder"
            ) from None
        placeholder_id = int(config.image_token_id)
        return family(processor, placeholder_id, tokenizer.convert_ids_to_tokens(placeholder_id))

    @staticmethod
    @abc.abstractmethod
    def load_processor(model_path: str) -> Any:
        """The family's processor of the model folder ``model_path``."""

    def grids(self, images: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """Each image's grid (:data:`PIXEL_ROWS`)."""
        if not images:
            return []
        return [tuple(int(v) for v in row) for row in self.model_inputs([images])[self.grid_field][0]]

    @abc.abstractmethod
    def expansion(self, grid: Sequence[int]) -> list[int]:
        """The tokens that replace the placeholder of an image of ``grid``."""

    @abc.abstractmethod
    def model_inputs(self, samples: Sequence[Sequence[bytes]]) -> dict[str, list[torch.Tensor]]:
        """The image fields (:attr:`fields`) of each sample (a list of encoded images)."""

    def widen(
        self, ids: list[int], mask: list[int], grids: Sequence[Sequence[int]]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """``ids`` with the ``k``-th placeholder replaced by the tokens of an image of ``grids[k]``,
        ``mask`` with 0 on them, and the [start, end) span of each image's tokens. A
        :class:`RowError` when the placeholders are not one per image."""
        found = ids.count(self.placeholder_id)
        if found != len(grids):
            raise RowError(
                f"the row has {len(grids)} images, but the chat template wrote {found} image placeholders "
                f"({self.placeholder}); each image needs one {{'type': 'image'}} part in the messages"
            )
        out_ids: list[int] = []
        out_mask: list[int] = []
        spans = []
        expansions = iter([self.expansion(grid) for grid in grids])
        for token, m in zip(ids, mask, strict=True):
            if token == self.placeholder_id:
                tokens = next(expansions)
                spans.append((len(out_ids), len(out_ids) + len(tokens)))
                out_ids += tokens
                out_mask += [0] * len(tokens)
            else:
                out_ids.append(token)
                out_mask.append(m)
        return out_ids, out_mask, spans

    def collapse(self, ids: Sequence[int], grids: Sequence[Sequence[int]]) -> list[int]:
        """``ids`` with the tokens of each image (of ``grids[k]``, in order) put back to the one
        placeholder the chat template wrote: what :meth:`widen` widened, as an engine whose own
        processor widens placeholders takes it. A ``ValueError`` when an image's tokens are not
        there, or when placeholders remain beyond the images' (the model generated some: such an
        engine would read them as images)."""
        ids, out, cursor = list(ids), [], 0
        for k, grid in enumerate(grids):
            tokens = self.expansion(grid)
            start = next((i for i in range(cursor, len(ids) - len(tokens) + 1) if ids[i:i + len(tokens)] == tokens), None)
            if start is None:
                raise ValueError(f"image {k}'s {len(tokens)} tokens are not in the prompt after token {cursor}")
            out += [*ids[cursor:start], self.placeholder_id]
            cursor = start + len(tokens)
        out += ids[cursor:]
        extra = out.count(self.placeholder_id) - len(grids)
        if extra:
            raise ValueError(f"the prompt holds {extra} {self.placeholder} token(s) beyond its {len(grids)} images' "
                             "(generated by the model)")
        return out


class PatchGridImages(ImageInputs):
    """Qwen2-VL and Qwen2.5-VL: an image is a (t, h, w) grid of patches, one token per
    ``merge_size x merge_size`` of them."""

    model_types = ("qwen2_vl", "qwen2_5_vl")
    grid_field = "image_grid_thw"

    @staticmethod
    def load_processor(model_path: str) -> Any:
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(model_path)
        if not hasattr(processor, "merge_size"):
            raise ValueError(f"it is a {type(processor).__name__}, which gives no patch grids (image_grid_thw)")
        return processor

    def expansion(self, grid: Sequence[int]) -> list[int]:
        t, h, w = grid
        return [self.placeholder_id] * (t * h * w // int(self.processor.merge_size) ** 2)

    def model_inputs(self, samples: Sequence[Sequence[bytes]]) -> dict[str, list[torch.Tensor]]:
        outputs = [self.processor(images=[decode_image(b) for b in images], return_tensors="pt") if images
                   else None for images in samples]
        features = next((out["pixel_values"].shape[1] for out in outputs if out is not None), 0)
        return {
            "pixel_values": [out["pixel_values"].float() if out else torch.zeros(0, features) for out in outputs],
            "image_grid_thw": [out["image_grid_thw"].long() if out else torch.zeros(0, 3, dtype=torch.long)
                               for out in outputs],
        }


class TiledImages(ImageInputs):
    """Idefics3 and SmolVLM: an image is cut into rows x columns tiles (none when the processor
    does not split it) plus the whole image as one more tile, each tile ``image_seq_len``
    tokens after its tag. Each tile's pixels are one row of ``pixel_values``."""

    model_types = ("idefics3", "smolvlm")
    grid_field = "image_tiles"

    @staticmethod
    def load_processor(model_path: str) -> Any:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(model_path)

    def expansion(self, grid: Sequence[int]) -> list[int]:
        _, rows, cols = grid
        text = self.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
        return list(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def model_inputs(self, samples: Sequence[Sequence[bytes]]) -> dict[str, list[torch.Tensor]]:
        pixels, tiles = [], []
        side = int(self.processor.image_processor.max_image_size["longest_edge"])
        for images in samples:
            own, grid = [], []
            for data in images:
                out = self.processor.image_processor(images=[[decode_image(data)]], return_row_col_info=True,
                                                     return_tensors="pt")
                if not bool(out["pixel_attention_mask"].all()):
                    raise RowError("the image processor padded an image's tiles; posttrain takes tiles it fills "
                                   "(set do_pad false, or resize the images to whole tiles)")
                values = out["pixel_values"][0]
                own.append(values.reshape(len(values), -1).float())
                grid.append((len(values), int(out["rows"][0][0]), int(out["cols"][0][0])))
            pixels.append(torch.cat(own) if own else torch.zeros(0, 3 * side * side))
            tiles.append(torch.tensor(grid, dtype=torch.long).reshape(-1, 3))
        return {"pixel_values": pixels, "image_tiles": tiles}
