"""A vision-language model's forward with images, as the trainer and the engines run it.

A row's image tokens are its first placeholders (Qwen-VL's ``<|image_pad|>``): as many as its
images' patch grids give features. A placeholder the model generated itself (a random or young
model samples one now and then) is text: the engine embedded it as a token when it decoded it,
so the trainer and a later prefill must too. transformers would scatter image features onto
every placeholder and refuse the count, so the embeddings are built here
(:func:`embed_with_images`) and the model is given them, with M-RoPE positions computed from
the image tokens alone (:func:`mrope_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def image_token_mask(input_ids: torch.Tensor, grids: Sequence[torch.Tensor], model: Any) -> torch.Tensor:
    """Bool [rows, width]: row ``i``'s first placeholders, as many as its images (patch ``grids[i]``,
    [images, 3]) give features."""
    merge = model.config.vision_config.spatial_merge_size
    placeholders = input_ids == model.config.image_token_id
    wanted = torch.tensor([int(grid.prod(-1).sum()) // merge**2 for grid in grids], device=input_ids.device)
    return placeholders & (placeholders.cumsum(-1) <= wanted[:, None])


def embed_with_images(
    model: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor, grids: torch.Tensor, image_mask: torch.Tensor
) -> torch.Tensor:
    """The token embeddings of ``input_ids`` with the vision tower's features of ``pixel_values``
    (the images' patches in order, patch ``grids`` [images, 3]) on the ``image_mask`` positions,
    in row-major order. Call inside the module whose forward owns the weights (FSDP gathers
    them there)."""
    embeds = model.get_input_embeddings()(input_ids)
    features = model.base_model.get_image_features(pixel_values.to(embeds.dtype), grids, return_dict=True)
    features = torch.cat(features.pooler_output).to(embeds.dtype)
    if int(image_mask.sum()) != features.shape[0]:
        raise ValueError(f"{int(image_mask.sum())} image tokens for {features.shape[0]} image features")
    return embeds.masked_scatter(image_mask[..., None], features)


def mrope_positions(
    model: Any, input_ids: torch.Tensor, image_mask: torch.Tensor, grids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """[3, rows, width] M-RoPE positions (time, height, width) of rows whose image tokens are
    ``image_mask`` (``grids``: every row's images in row order); ``attention_mask`` marks the
    real tokens (left or right padding)."""
    positions, _ = model.base_model.get_rope_index(input_ids, image_mask.int(), image_grid_thw=grids,
                                                   attention_mask=attention_mask)
    return positions
