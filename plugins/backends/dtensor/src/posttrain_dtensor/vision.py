"""A vision-language model's image inputs for one forward pass, laid out like its rows.

A microbatch of image rows carries, per sample, its pixel values and patch grids
(:data:`posttrain.data.images.IMAGE_FIELDS`). The model takes them concatenated in the order
their placeholder tokens appear in the flattened rows (it scatters image features onto those
tokens in order), ``mm_token_type_ids`` (1 on image tokens) and, for Qwen-VL's M-RoPE, three
position planes (time, height, width) that image tokens advance by patch. Padded rows leave
the positions to the model. Packed rows restart positions per sample: each sample's planes
are computed on its own, then packed, after the restarting text positions (transformers'
layout of 4 planes, from which it reads the packed samples' bounds).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.batch import Batch
from posttrain.data.images import sample_images
from posttrain_dtensor.rows import ModelRows


def image_model_inputs(mb: Batch, rows: ModelRows, lm: Any) -> dict[str, torch.Tensor]:
    """Keyword arguments for ``lm.base_model`` on ``rows`` of microbatch ``mb``: none for a
    microbatch without images."""
    if "image_grid_thw" not in mb:
        return {}
    images = [sample_images(mb, i) for i in range(len(mb))]
    if not any(len(grid) for _, grid in images):
        return {}
    if rows.prefixes is not None:
        raise ValueError("exact logprobs score prefixes of samples; image rows cannot be laid out on them")
    order = [i for row in rows.packed.bins for i in row] if rows.packed is not None else range(len(mb))
    device = rows.input_ids.device
    inputs = {
        "pixel_values": torch.cat([images[i][0] for i in order]).to(device),
        "image_grid_thw": torch.cat([images[i][1] for i in order]).to(device),
        "mm_token_type_ids": image_tokens(rows.input_ids, lm).int(),
    }
    if rows.packed is not None:
        inputs["position_ids"] = packed_positions(mb, rows, torch.cat([grid for _, grid in images]), lm)
    return inputs


def image_tokens(input_ids: torch.Tensor, lm: Any) -> torch.Tensor:
    """True on the image placeholder tokens of ``input_ids``."""
    return input_ids == lm.config.image_token_id


def packed_positions(mb: Batch, rows: ModelRows, grids: torch.Tensor, lm: Any) -> torch.Tensor:
    """[4, R, T]: the packed rows' restarting text positions, then each sample's M-RoPE planes
    (computed on the sample alone; ``grids``: the samples' patch grids in sample order) packed
    like its tokens."""
    assert rows.packed is not None
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    planes, _ = lm.base_model.get_rope_index(ids, image_tokens(ids, lm).int(), image_grid_thw=grids,
                                             attention_mask=valid.long())
    packed = torch.stack([rows.packed.pack(plane) for plane in planes.cpu()])
    return torch.cat([rows.position_ids.cpu()[None], packed]).to(rows.input_ids.device)
