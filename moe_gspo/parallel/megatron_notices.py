"""Megatron-core's notices that Apex and Transformer Engine are absent, silenced because that absence is expected.

megatron-core warns (UserWarning, at import) in several modules when NVIDIA Apex or Transformer Engine is not
installed: "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", "Apex is not installed.
Falling back to Torch Norm", ... This package builds its model from the local spec with its own norms and runs
torch's Adam wherever those libraries are absent (the CPU setup, and model.spec=local on a GPU), and model.spec=te
refuses to start without Transformer Engine, so those notices tell a user nothing.

`quiet_missing_backends()` ignores exactly them: UserWarnings raised from megatron's own modules whose message says
Apex and/or Transformer Engine is not installed. Every other warning, megatron's included, is shown as usual.
moe_gspo/__init__.py calls it, so it is in effect before any moe_gspo module imports megatron. This module imports
nothing but `warnings`, so that `import moe_gspo` stays light.
"""

from __future__ import annotations

import warnings

MISSING_BACKEND = r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"
MEGATRON_MODULES = r"megatron(\.|_fsdp\.)"  # megatron.core.*, and megatron_fsdp.* when imported under that name


def quiet_missing_backends() -> None:
    """Ignore megatron's UserWarnings that Apex / Transformer Engine are not installed (idempotent)."""
    warnings.filterwarnings("ignore", message=MISSING_BACKEND, category=UserWarning, module=MEGATRON_MODULES)
