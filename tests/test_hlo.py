"""The HLO collective parser: kinds, buffers, group sizes and loop trip counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxlight.analysis._hlo import KINDS, collectives, summarize

SYNTHETIC = """\
HloModule jit_step, num_partitions=8

%body.1 (p: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {
  %p = (s32[], f32[16,32]{1,0}) parameter(0)
  %ag = f32[16,32]{1,0} all-gather(f32[2,32]{1,0} %x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %ar = (f32[4,32]{1,0}, bf16[8]{0}) all-reduce(%a, %b), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  ROOT %t = (s32[], f32[16,32]{1,0}) tuple(%i, %ag)
}

%cond.1 (p: (s32[], f32[16,32])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[2,32]) -> f32[2,32] {
  %w = (s32[], f32[16,32]{1,0}) while(%init), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"4"}}
  %rs = f32[2,32]{1,0} reduce-scatter(f32[16,32]{1,0} %g), channel_id=3, replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}, dimensions={0}, to_apply=%add
  %cp = f32[2,32]{1,0} collective-permute(%x), channel_id=4, source_target_pairs={{0,1},{1,0}}
  ROOT %r = f32[2,32]{1,0} copy(%rs)
}
"""  # noqa: E501


def test_parses_kinds_groups_and_trip_counts():
    found = {c.name: c for c in collectives(SYNTHETIC)}
    assert set(found) == {"ag", "ar", "rs", "cp"}
    ag, ar, rs, cp = found["ag"], found["ar"], found["rs"], found["cp"]
    assert (ag.kind, ag.group_size, ag.executions, ag.in_loop) == ("all-gather", 8, 4, True)
    assert ag.buffer_bytes == 16 * 32 * 4
    assert ag.traffic_bytes == pytest.approx(7 / 8 * 16 * 32 * 4)
    assert ar.shapes == (("f32", (4, 32)), ("bf16", (8,)))
    assert ar.result_bytes == 4 * 32 * 4 + 8 * 2 and ar.group_size == 4
    assert ar.traffic_bytes == pytest.approx(2 * 3 / 4 * ar.result_bytes)
    assert (rs.group_size, rs.executions, rs.buffer_bytes) == (4, 1, 2 * 32 * 4 * 4)
    assert cp.traffic_bytes == cp.buffer_bytes == 2 * 32 * 4
    totals = summarize(found.values())
    assert list(totals) == list(KINDS)
    assert totals["all-gather"]["count"] == 4
    assert totals["all-gather"]["buffer_bytes"] == 4 * ag.buffer_bytes
    assert totals["all-to-all"]["count"] == 0


def test_real_compiled_all_reduce_and_loop():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x_sharding = NamedSharding(mesh, PartitionSpec("data"))

    def step(w, x):
        def body(w, _):
            g = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)  # batch-sharded: an all-reduce
            return w - 0.1 * g, None

        return jax.lax.scan(body, w, None, length=3)[0]

    compiled = jax.jit(step, in_shardings=(NamedSharding(mesh, PartitionSpec()), x_sharding)
                       ).lower(jnp.ones((16, 4)), jnp.ones((64, 16))).compile()
    reduces = [c for c in collectives(compiled.as_text()) if c.kind == "all-reduce"]
    assert reduces, "a gradient over a sharded batch needs an all-reduce"
    grad = [c for c in reduces if c.buffer_bytes == 16 * 4 * 4]
    assert grad and all(c.executions == 3 and c.group_size == 8 for c in grad)
    assert np.isclose(sum(c.total_traffic_bytes for c in grad), 3 * 2 * 7 / 8 * 256)
