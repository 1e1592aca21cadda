"""scripts/inductor_bandwidth.py: the table of Inductor's bandwidth profiler, on files written in its own format."""

import runpy
from pathlib import Path

import pytest
from torch._inductor.runtime.runtime_utils import create_bandwidth_info_str

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "inductor_bandwidth.py"


def graph_table(graph: str, calls: list[tuple[float, float, str]]) -> str:
    """What ``end_graph`` appends after one call of a compiled graph (torch/_inductor/runtime/triton_heuristics.py)."""
    total = sum(ms for ms, _, _ in calls)
    lines = ["====================", f"TRITON KERNELS BANDWIDTH INFO ({graph})"]
    for ms, gb, name in sorted(calls, reverse=True):
        suffix = f" \t {ms / total * 100:.2f}% \t {name}"
        line = create_bandwidth_info_str(ms, gb, gb / (ms / 1e3), suffix=suffix, color=False)
        lines.append(f"\x1b[31m{line}\x1b[0m" if gb / ms < 2.5 else line)  # as some versions colour slow kernels
    lines.append(f"SUMMARY ({graph})\n{total:.2f}ms   \t 1.00 GB\t 1.00GB/s\n")
    return "\n".join(lines) + "\n"


def test_ranks_kernels_by_time_lost_against_the_floor(tmp_path, capsys):
    out = tmp_path / "bw.txt"
    forward = [(0.5, 1.6, "triton_red_fused_layer_norm_1"), (0.4, 1.6, "triton_per_fused_layer_norm_2")]
    out.write_text(
        graph_table("/tmp/fwd.py", [(9.0, 1.0, "stale")])  # an earlier call of the same graph: replaced
        + graph_table("/tmp/fwd.py", forward + [(0.5, 1.6, "triton_red_fused_layer_norm_1")])
        + graph_table("/tmp/bwd.py", [(1.0, 2.0, "triton_poi_fused_gelu_backward_3")])
    )
    rows = runpy.run_path(str(SCRIPT))["main"]([str(out), "--peak-tbs", "4"])
    by_name = {row["kernel"]: row for row in rows}
    kernels = {"triton_red_fused_layer_norm_1", "triton_per_fused_layer_norm_2", "triton_poi_fused_gelu_backward_3"}
    assert set(by_name) == kernels  # the earlier table of the forward graph is gone
    red = by_name["triton_red_fused_layer_norm_1"]  # two calls: 1.0 ms for 3.2 GB, floor 0.8 ms at 4 TB/s
    assert red["calls"] == 2 and red["ms"] == pytest.approx(1.0) and red["lost ms"] == pytest.approx(0.2)
    assert [row["kernel"] for row in rows][0] == "triton_poi_fused_gelu_backward_3"  # 1.0 - 0.5 = 0.5 lost
    assert by_name["triton_per_fused_layer_norm_2"]["GB/s"] == pytest.approx(4000)
    printed = capsys.readouterr().out
    assert "2 graphs" in printed and "| kernel | calls |" in printed and "lost 0.700 ms" in printed  # 0.2 + 0.0 + 0.5


def test_a_file_without_tables_names_the_switches(tmp_path):
    empty = tmp_path / "bw.txt"
    empty.write_text("nothing profiled\n")
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit, match="TORCHINDUCTOR_PROFILE=1"):
        main([str(empty)])
    with pytest.raises(SystemExit, match="TORCHINDUCTOR_PROFILE_OUTPUT"):
        main([str(tmp_path / "missing.txt")])
    with pytest.raises(SystemExit, match="--peak-tbs must be > 0"):
        main([str(empty), "--peak-tbs", "0"])
