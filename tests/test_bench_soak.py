"""`jlora bench soak` for a minute on the tiny model: `jlora serve` as a subprocess under Poisson
load with streams, walk-aways and adapter churn loses nothing, keeps its greedy output and its memory."""

from __future__ import annotations

import json

import pytest

from jlora.bench import soak


@pytest.mark.slow
def test_a_minute_of_soak_loses_nothing_and_keeps_output_and_memory(tmp_path):
    args = soak.parser().parse_args(["--duration", "60", "--rate", "2", "--churn-every", "8", "--probe-every", "6",
                                     "--out", str(tmp_path)])
    r = soak.run(args)
    summary = {k: r[k] for k in ("sent", *soak.OUTCOMES, "http_5xx", "churn_statuses", "server_exit_code",
                                 "rss_mib_after_10s", "rss_mib_end", "problems")}
    assert r["sent"] >= 60, summary
    assert r["lost"] == 0 and r["http_5xx"] == 0 and r["rejected"] == 0, summary
    assert r["completed"] >= r["sent"] // 2 and r["walked_away"] > 0, summary
    assert r["probe_unchanged"] and r["probe_adapter_differs"] and len(r["probes"]) >= 10, r["probes"]
    assert len(r["churns"]) >= 6 and all(s == 200 for s in r["churn_statuses"]), r["churns"]
    assert r["server_exit_code"] == 0, r.get("server_log_tail")
    assert r["end_state"]["idle"] and r["end_state"]["compiles_after_warmup"] == 0, r["end_state"]
    # Generous: allocator and compile-cache noise, not a leak of one request's state per request.
    assert r["rss_mib_end"] <= 1.25 * r["rss_mib_after_10s"] + 64, r["rss_mib"]
    assert json.loads((tmp_path / "soak.json").read_text())["sent"] == r["sent"]
    assert "| sent | completed |" in (tmp_path / "soak.md").read_text()
