"""Graph passes over :class:`ssmshard.Program`.

A pass is a plain function ``(program, ctx) -> program`` registered under a name::

    @ssmshard.passes.register("fold_casts")
    def fold_casts(program, ctx):
        ...
        return program

``run_pipeline(program, ["tag", "fold_casts", ("my_pass", {"option": 1})])`` runs passes in
order; after each one the graph is verified (lint, fake-tensor re-propagation, tag
integrity) and an op-count diff is recorded in ``program.history``. A verification failure
names the pass that broke the graph.
"""

from .manager import (CAPTURE_PASSES, PassContext, PassVerificationError, get, register, registered, replay,
                      run_pipeline, unregister, verify)
from . import canonicalize, causal_attention, decode_attention, decode_gemv, fold_cache_positions, fold_weights, fuse_cache_write, fuse_dt_proj, fuse_gated_activation, fuse_gemv_conv, fuse_rmsnorm, fuse_rotary, group_decode_linears, hoist_attention_mask, inplace_states, quantize_sync, scan_outputs, shard, spd, swap_kernels, tag, token_major_in_proj, tsp  # noqa: F401  (register the built-in passes)

__all__ = ["CAPTURE_PASSES", "PassContext", "PassVerificationError", "get", "register", "registered", "replay", "run_pipeline",
           "unregister", "verify"]
