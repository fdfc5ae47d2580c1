"""Warnings from megatron-core and torch that tell a user nothing they can act on, silenced; every other warning
is shown as usual.

- megatron-core warns (UserWarning, at import) in several modules when NVIDIA Apex or Transformer Engine is not
  installed: "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", "Apex is not
  installed. Falling back to Torch Norm", ... This package builds its model from the local spec with its own norms
  and runs torch's Adam wherever those libraries are absent (the CPU setup, and model.spec=local on a GPU), and
  model.spec=te refuses to start without Transformer Engine, so those notices tell a user nothing.
- megatron's distributed optimizer zeroes the gradients of its fp32 parameter shards, which are views of the model's
  parameters; reading .grad on a view makes torch warn that it "is not a leaf Tensor", once per rank and step.
- megatron's gradient buffers call torch.distributed.all_gather_into_tensor and reduce_scatter_tensor, which torch
  deprecates (FutureWarning), once per rank.

A multi-rank run printed each of these from every rank. `quiet_missing_backends()` ignores exactly them, matched
by message, category and the module that raises them. moe_gspo/__init__.py calls it, so it is in effect before any
moe_gspo module imports megatron. This module imports nothing but `warnings`, so that `import moe_gspo` stays
light.
"""

from __future__ import annotations

import warnings

MISSING_BACKEND = r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"
MEGATRON_MODULES = r"megatron(\.|_fsdp\.)"  # megatron.core.*, and megatron_fsdp.* when imported under that name


NON_LEAF_GRAD = r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def quiet_missing_backends() -> None:
    """Ignore megatron's UserWarnings that Apex / Transformer Engine are not installed, its optimizer's reads of
    its shards' .grad, and torch's deprecation of the collectives megatron calls (idempotent)."""
    warnings.filterwarnings("ignore", message=MISSING_BACKEND, category=UserWarning, module=MEGATRON_MODULES)
    warnings.filterwarnings("ignore", message=NON_LEAF_GRAD, category=UserWarning, module=r"megatron\.core\.optimizer")
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning,
                            module=r"torch\.distributed")
