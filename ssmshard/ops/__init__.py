"""``torch.ops.ssmshard``: the state-space-model ops (importing this registers them).

``signatures`` declares each op's arguments once; ``ssm`` registers the ops from it with
their reference implementations, fakes and autograd. The collectives live in ``ssmshard.comm``.
"""

from .signatures import SIGNATURES, OpSignature
from .ssm import (add_rms_norm, causal_conv1d, causal_conv1d_update, cu_seqlens_arg, decode_linear, decode_linear_group,
                  gated_rms_norm, rms_norm, selective_scan, selective_state_update, ssd_scan)

__all__ = ["SIGNATURES", "OpSignature", "add_rms_norm", "causal_conv1d", "causal_conv1d_update", "cu_seqlens_arg",
           "decode_linear", "decode_linear_group", "gated_rms_norm", "rms_norm", "selective_scan",
           "selective_state_update", "ssd_scan"]
