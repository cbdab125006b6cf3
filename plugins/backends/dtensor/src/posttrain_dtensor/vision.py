"""A vision-language model's image inputs for one forward pass, laid out like its rows.

A microbatch of image rows carries, per sample, its pixel values and its family's grids
(:data:`posttrain.data.images.IMAGE_FIELDS`). The model takes them concatenated in the order
their image tokens appear in the flattened rows, the image tokens themselves
(:func:`posttrain.backend.vision.image_token_mask`: an image token the policy generated is
text) and, for Qwen-VL, M-RoPE positions, three planes (time, height, width) that image tokens
advance by patch, computed on each sample alone. Packed rows restart positions per sample:
the planes are packed like the tokens, after the restarting text positions (transformers'
layout of 4 planes, from which it reads the packed samples' bounds). Idefics3 takes the
rows' own text positions.
:class:`~posttrain_dtensor.parallel.CausalLMHead` embeds the images inside its forward.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.backend.vision import has_mrope, image_token_mask, mrope_positions
from posttrain.batch import Batch
from posttrain.data.images import image_fields, sample_images
from posttrain_dtensor.rows import ModelRows


def image_model_inputs(mb: Batch, rows: ModelRows, lm: Any) -> dict[str, torch.Tensor]:
    """``pixel_values``, ``image_grids``, ``image_mask`` [R, T] and (M-RoPE) ``position_ids``
    for :class:`~posttrain_dtensor.parallel.CausalLMHead` on ``rows`` of microbatch ``mb``;
    none for a microbatch without images."""
    if not image_fields(mb):
        return {}
    images = [sample_images(mb, i) for i in range(len(mb))]
    if not any(len(grid) for _, grid in images):
        return {}
    if rows.prefixes is not None:
        raise ValueError("exact logprobs score prefixes of samples; image rows cannot be laid out on them")
    ids, lengths = mb["input_ids"], mb["input_lengths"]
    valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    mask = image_token_mask(ids, [grid for _, grid in images], lm)
    planes = mrope_positions(lm, ids, mask, torch.cat([grid for _, grid in images]), valid.long()) \
        if has_mrope(lm) else None
    if rows.packed is not None:
        order = [i for row in rows.packed.bins for i in row]
        mask = rows.packed.pack(mask, False)
        if planes is not None:
            planes = torch.cat([rows.position_ids.cpu()[None], torch.stack([rows.packed.pack(p) for p in planes])])
    else:
        order = list(range(len(mb)))
        width = rows.input_ids.shape[1]
        mask = mask[:, :width]
        planes = planes[:, :, :width] if planes is not None else None
    device = rows.input_ids.device
    inputs = {
        "pixel_values": torch.cat([images[i][0] for i in order]).to(device),
        "image_grids": torch.cat([images[i][1] for i in order]).to(device),
        "image_mask": mask.to(device),
    }
    if planes is not None:
        inputs["position_ids"] = planes.to(device)
    return inputs
