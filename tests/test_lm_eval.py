"""lm-evaluation-harness drives `jlora serve` unchanged: `local-completions` on a loglikelihood
(multiple-choice) task and `local-chat-completions` on a generate task, both written here, score as
lm-eval's own `hf` model does on the same data, per document too: HFLM over transformers' model of
the same GGUF file (the session's `hf_real`), with the adapter through peft as lm-eval's `peft=` adds it."""

from __future__ import annotations

import json

import pytest

from jlora.server.app import build_app
from live import KEY, serve_live
from test_real_adapters import make_peft_adapters

pytestmark = pytest.mark.slow

MC = [  # question, choices, index of the right one
    ("What is the capital of France?", [" Paris", " Rome", " Berlin"], 0),
    ("How many legs does a spider have?", [" six", " eight", " ten"], 1),
    ("Which animal says moo?", [" a cat", " a dog", " a cow"], 2),
    ("What colour is the sky on a clear day?", [" blue", " green", " red"], 0),
    ("What is 2 + 3?", [" 4", " 5", " 6", " 7"], 1),
    ("Which is a fruit?", [" a chair", " an apple", " a car"], 1),
]
GEN = [("What is 2 + 2? Answer with the number only.", "4"), ("Name the capital of Italy in one word.", "Rome"),
       ("Say the word 'yes'.", "yes"), ("What is the opposite of hot? One word.", "cold")]


def _tasks(root) -> None:
    """Two lm-eval tasks with their data as jsonl files, under `root` (lm-eval's include_path)."""
    (root / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                           for q, c, a in MC))
    (root / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "jlora_mc.yaml").write_text(
        f"task: jlora_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    (root / "jlora_gen.yaml").write_text(
        f"task: jlora_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0.0\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n")


def _hf_model(model, tok_dir):
    """lm-eval's `hf` model (`HFLM`) over an already loaded transformers model: the session's, read from
    the same GGUF file in float32, so the file is not parsed again (~20 s a load on the 2-core machine)."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=str(tok_dir), batch_size=1)


def _evaluate(model, model_args: dict | None, task: str, tasks, chat: bool) -> tuple[float, list]:
    import lm_eval

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                  task_manager=tasks, apply_chat_template=chat,
                                  log_samples=True, batch_size=1, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    metric = "acc,none" if task == "jlora_mc" else "exact_match,none"
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return out["results"][task][metric], [s["filtered_resps"] for s in samples]


@pytest.fixture(scope="module")
def setup(real_llm, hf_real, tmp_path_factory):
    from lm_eval.tasks import TaskManager

    from jlora.models import default_model_path
    from jlora.tokenizer import load_gguf_tokenizer

    root = tmp_path_factory.mktemp("lm_eval")
    _tasks(root)
    tasks = TaskManager(include_path=str(root))  # one index of lm-eval's task files (~4 s to build) for every run
    tok_dir = root / "tokenizer"
    load_gguf_tokenizer(default_model_path()).save_pretrained(tok_dir)
    spec = {"lm-eval-qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])}
    adapter = make_peft_adapters(hf_real[0], spec, tmp_path_factory.mktemp("lm_eval_adapter"), 7, 0.3)["lm-eval-qv"]
    app = build_app(real_llm, "smollm2", lora_modules={"qv": str(adapter)}, api_key=KEY)
    try:
        with serve_live(real_llm, app) as live:
            yield live, tasks, tok_dir, adapter
    finally:  # real_llm is the session's: the server's adapter (and its lora_int_id) must not outlive this module
        assert real_llm.engine.adapters.unload("qv")


@pytest.mark.parametrize("model", ["smollm2", "qv"])
def test_lm_eval_scores_through_the_server_equal_lm_evals_hf_model(setup, hf_real, model, monkeypatch):
    from peft import PeftModel

    live, tasks, tok_dir, adapter = setup
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # lm-eval's API models send it as the bearer token
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Both sides tokenize with jlora's tokenizer (saved in HF format): transformers' own GGUF tokenizer
    # splits two spaces before a digit differently ("  4": [216, 216, 36], jlora [256, 36]), which
    # would be a tokenizer comparison, not a server one.
    api = {"model": model, "tokenizer_backend": "huggingface", "tokenizer": str(tok_dir), "max_retries": 1,
           "num_concurrent": 1}
    # The adapter as lm-eval's `peft=` applies it: PeftModel.from_pretrained over the base model.
    reference = hf_real[0] if model == "smollm2" else PeftModel.from_pretrained(hf_real[0], str(adapter))
    try:
        hf_lm = _hf_model(reference, tok_dir)
        served_acc, served_ll = _evaluate("local-completions", {**api, "base_url": live.base_url + "/v1/completions"},
                                          "jlora_mc", tasks, chat=False)
        hf_acc, hf_ll = _evaluate(hf_lm, None, "jlora_mc", tasks, chat=False)
        assert served_acc == hf_acc
        for served, ref in zip(served_ll, hf_ll, strict=True):  # per choice: (loglikelihood, is_greedy)
            assert [round(float(ll), 3) for ll, _ in served] == pytest.approx([float(ll) for ll, _ in ref], abs=2e-3)

        served_em, served_text = _evaluate("local-chat-completions",
                                           {**api, "base_url": live.base_url + "/v1/chat/completions"},
                                           "jlora_gen", tasks, chat=True)
        hf_em, hf_text = _evaluate(hf_lm, None, "jlora_gen", tasks, chat=True)
        assert served_text == hf_text
        assert served_em == hf_em
    finally:
        if reference is not hf_real[0]:
            reference.unload()  # the session's model without the adapter's layers again
