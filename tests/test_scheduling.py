"""Scheduling when adapters outnumber slots: adapter-aware admission, its starvation bound, and
outputs that do not depend on the policy (tiny model, real peft adapters)."""

import pytest

from jlora import LLM, LoRARequest, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=1, max_lora_rank=8,
              token_buckets=(16, 32))


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    return {p: LLM(str(tiny_dir[0]), progress=False, scheduling_policy=p, max_overtakes=3, **ENGINE)
            for p in ("adapter_aware", "fcfs")}


def _lora(tiny_adapters, i):
    return LoRARequest(f"s{i}", 300 + i, str(tiny_adapters[i]))


def test_resident_adapter_requests_overtake_one_waiting_for_a_slot(engines, tiny_adapters):
    for policy, llm in engines.items():
        eng = llm.engine
        eng.add_request("Hello there", greedy(30), _lora(tiny_adapters, 0), request_id="long")
        eng.step()  # "long" pins the only slot
        eng.add_request("Hello", greedy(4), _lora(tiny_adapters, 1), request_id="cold")
        eng.add_request("Hi", greedy(4), _lora(tiny_adapters, 0), request_id="warm")
        eng.step()
        running = {s.request_id for s in eng.running}
        if policy == "adapter_aware":
            assert running == {"long", "warm"}  # "warm" went ahead of "cold", whose adapter has no slot
        else:
            assert running == {"long"}  # strict FIFO: "warm" waits behind "cold"
        while eng.has_unfinished():
            eng.step()
        for rid in ("long", "cold", "warm"):
            assert eng.pop_finished(rid).outputs[0].finish_reason == "length"


def test_a_cold_adapter_is_overtaken_at_most_max_overtakes_times(engines, tiny_adapters):
    eng = engines["adapter_aware"].engine
    eng.add_request("Hello there", greedy(40), _lora(tiny_adapters, 0), request_id="pin")
    eng.step()
    eng.add_request("Hello", greedy(3), _lora(tiny_adapters, 2), request_id="cold")
    cold = eng.requests["cold"].seqs[0]
    stream = []
    while cold in eng.waiting:
        if len(stream) < 30:  # a steady stream of requests for the resident adapter
            stream.append(eng.add_request("Hi", greedy(2), _lora(tiny_adapters, 0)))
        eng.step()
        assert cold.num_overtaken <= 3
    waiting = {s.request_id for s in eng.waiting}
    admitted_first = [r for r in stream if r not in waiting]
    assert cold.num_overtaken == 3 and len(admitted_first) == 3  # then it held the queue until the slot freed
    assert len(stream) > 3  # the stream kept coming: later requests waited behind it
    while eng.has_unfinished():
        eng.step()
    for rid in ["pin", "cold", *stream]:
        eng.pop_finished(rid)


def test_outputs_do_not_depend_on_the_policy(engines, tiny_adapters):
    prompts = [f"Number {i} is" for i in range(10)]
    loras = [_lora(tiny_adapters, i % 3) if i % 4 else None for i in range(10)]
    params = [greedy(3 + i % 5) for i in range(10)]
    outs = {p: [o.outputs[0].token_ids for o in llm.generate(prompts, params, loras, use_tqdm=False)]
            for p, llm in engines.items()}
    assert outs["adapter_aware"] == outs["fcfs"]


def test_bad_policy_is_rejected(tiny_dir):
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(str(tiny_dir[0]), progress=False, scheduling_policy="random", **ENGINE)


def test_prefill_prefers_fewer_prompts_when_the_yield_is_nearly_the_same():
    """TuningOptions.prefill_slack: a burst of 1,024-token prompts is prefilled one a step (its first prompt then
    decodes after one step, not 32), while short prompts still share a step; None keeps the best
    yield alone (the first of equal shapes: 32 prompts x 32 tokens)."""
    from types import SimpleNamespace

    from jlora.engine import scheduler
    from jlora.engine.config import EngineConfig

    cfg = EngineConfig(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024, token_buckets=(32, 128, 1024))
    planner = SimpleNamespace(config=cfg, can_run=lambda shape: True, prefill_slack=cfg.tuning.prefill_slack)

    def choose(n, length, done=0):
        seqs = [SimpleNamespace(total_len=length, num_computed=done) for _ in range(n)]
        shape, take = scheduler.Scheduler._choose_prefill(planner, seqs)
        assert take == seqs[:shape[0]]
        return shape

    assert cfg.tuning.prefill_slack == 0.05
    assert choose(64, 1024) == (1, 1024)
    assert choose(64, 1000) == (1, 1024)  # 2.4% fewer prompt tokens per token computed than 32 x 32
    assert choose(40, 20) == (32, 32)  # short prompts: one at a time would carry a fraction
    # eight prompts' last 24 tokens go together: one prompt a step would carry 10% less per token computed
    assert choose(8, 1024, done=1000)[0] >= 8
    planner.prefill_slack = None  # TuningOptions(prefill_slack=None): the best yield alone
    assert choose(64, 1024) == (32, 32)
    assert choose(40, 20) == (32, 32)
    # A background warm-up that has compiled only the full chunk's graph: short prompts go one a step.
    planner.can_run = lambda shape: shape == (64, 1, 1024)
    assert choose(40, 20) == (1, 1024)
    planner.can_run = lambda shape: shape[1:] in ((1, 1024), (8, 128))
    assert choose(40, 20) == (8, 128)
