"""LLMEngine.add_step_listener: a benchmark's view of every step without patching the engine."""

from __future__ import annotations

import pytest

from jlora.engine.step_listener import PHASES, StepListener


class Recorder(StepListener):
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def step_started(self) -> None:
        self.events.append(("start",))

    def step_finished(self, seconds: float) -> None:
        assert seconds >= 0
        self.events.append(("end",))

    def phase(self, name: str, seconds: float) -> None:
        assert name in PHASES and seconds >= 0
        self.phases[name] += seconds

    def launched(self, batch, handle, prev, started) -> None:
        self.events.append(("launch", id(handle), int((batch["pre_positions"] >= 0).sum())))

    def collected(self, handle, started, done) -> None:
        assert done >= started
        self.events.append(("collect", id(handle)))


def test_listeners_see_every_step_phase_launch_and_collect(tiny_dir):
    from jlora import LLM, SamplingParams
    from jlora.bench.tpu.workloads import HostPhases, StepLog

    with LLM(str(tiny_dir[0]), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, max_loras=2,
             max_lora_rank=8, progress=False, use_compilation_cache=False, executable_cache=False,
             weights_cache=False) as llm:
        rec, log, host = Recorder(), StepLog(1000, 10, 0), HostPhases()
        for listener in (rec, log, host):
            llm.engine.add_step_listener(listener)
        with pytest.raises(TypeError, match="StepListener"):
            llm.engine.add_step_listener(object())  # type: ignore[arg-type]
        prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]}]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
        steps = rec.events.count(("start",))
        assert steps >= 6 and steps == rec.events.count(("end",)) == len(host.calls)
        launches = [e for e in rec.events if e[0] == "launch"]
        collects = [e for e in rec.events if e[0] == "collect"]
        assert sorted(e[1] for e in launches) == sorted(e[1] for e in collects)  # each launched step collected
        assert sum(e[2] for e in launches) == 8  # the two prompts' tokens, prefilled once
        assert all(rec.phases[p] > 0 for p in ("schedule", "build_batch", "launch", "wait_device", "process"))
        # The bench's listeners: one record per launched step, decode steps against its byte count.
        assert len(log.records) == len(launches) and all(r["seconds"] >= 0 for r in log.records)
        assert log.decode_summary(log.records)["decode_steps"] >= 4
        assert host.summary()["decode_calls"] >= 4
        for listener in (rec, log, host):
            llm.engine.remove_step_listener(listener)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        assert rec.events.count(("start",)) == steps  # removed: told nothing more
        # async scheduling switched between runs (the bench compares both on one engine's graphs)
        llm.engine.async_scheduling = not llm.engine.async_scheduling
        with pytest.raises(ValueError, match="async_scheduling"):
            llm.engine.async_scheduling = "yes"  # type: ignore[assignment]
