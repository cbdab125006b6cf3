"""A vision-language model's forward with images, as the trainer and the engines run it.

A row's image tokens are its first image-token positions (Qwen-VL's ``<|image_pad|>``,
Idefics3's ``<image>``): as many as its images give features. An image token the model
generated itself (a random or young model samples one now and then) is text: the engine
embedded it as a token when it decoded it, so the trainer and a later prefill must too.
transformers would scatter image features onto every image token and refuse the count, so
the embeddings are built here (:func:`embed_with_images`) and the model is given them. Qwen-VL
takes M-RoPE positions computed from the image tokens alone (:func:`mrope_positions`);
Idefics3 takes the text's positions.

Each sample's images arrive as pixel values and its family's grids
(:data:`posttrain.data.images.PIXEL_ROWS`): Qwen-VL's patches [patches, features] with
(t, h, w) grids; Idefics3's tiles [tiles, 3 x side x side] with (tiles, rows, columns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posttrain.data.images import TiledImages

#: model types whose images are tiles (Idefics3's layout); every other is Qwen-VL's.
TILED = TiledImages.model_types


def has_mrope(model: Any) -> bool:
    """Whether ``model`` takes M-RoPE positions (three planes) rather than the text's."""
    return model.config.model_type not in TILED


def image_features_per_image(grids: torch.Tensor, model: Any) -> torch.Tensor:
    """[images]: the features (image tokens) each image of ``grids`` [images, 3] gives."""
    if model.config.model_type in TILED:
        return grids[:, 0] * _tile_tokens(model.config)
    return grids.prod(-1) // model.config.vision_config.spatial_merge_size**2


def image_token_mask(input_ids: torch.Tensor, grids: Sequence[torch.Tensor], model: Any) -> torch.Tensor:
    """Bool [rows, width]: row ``i``'s first image tokens, as many as its images (``grids[i]``,
    [images, 3]) give features."""
    placeholders = input_ids == model.config.image_token_id
    wanted = torch.stack([image_features_per_image(grid, model).sum() for grid in grids]).to(input_ids.device)
    return placeholders & (placeholders.cumsum(-1) <= wanted[:, None])


def embed_with_images(
    model: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor, grids: torch.Tensor, image_mask: torch.Tensor
) -> torch.Tensor:
    """The token embeddings of ``input_ids`` with the vision tower's features of ``pixel_values``
    (the images' pixel rows in order, ``grids`` [images, 3]) on the ``image_mask`` positions,
    in row-major order. Call inside the module whose forward owns the weights (FSDP gathers
    them there)."""
    embeds = model.get_input_embeddings()(input_ids)
    pixels = pixel_values.to(embeds.dtype)
    if model.config.model_type in TILED:
        side = model.config.vision_config.image_size
        out = model.base_model.get_image_features(pixels.view(1, -1, 3, side, side), return_dict=True)
        features = out.pooler_output.reshape(-1, embeds.shape[-1])
    else:
        out = model.base_model.get_image_features(pixels, grids, return_dict=True)
        features = torch.cat(out.pooler_output)
    features = features.to(embeds.dtype)
    if int(image_mask.sum()) != features.shape[0]:
        raise ValueError(f"{int(image_mask.sum())} image tokens for {features.shape[0]} image features")
    return embeds.masked_scatter(image_mask[..., None], features)


def mrope_positions(
    model: Any, input_ids: torch.Tensor, image_mask: torch.Tensor, grids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """[3, rows, width] M-RoPE positions (time, height, width) of rows whose image tokens are
    ``image_mask`` (``grids``: every row's images in row order); ``attention_mask`` marks the
    real tokens (left or right padding). Qwen-VL only (:func:`has_mrope`)."""
    positions, _ = model.base_model.get_rope_index(input_ids, image_mask.int(), image_grid_thw=grids,
                                                   attention_mask=attention_mask)
    return positions


def _tile_tokens(config: Any) -> int:
    """Image tokens per Idefics3 tile: its patches, shuffled ``scale_factor`` x ``scale_factor`` into one."""
    patches = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    return patches // config.scale_factor**2
