"""The committed demo adapters show their trained behaviours, all together in one mixed batch."""

import pytest

from jlora import LoRARequest, SamplingParams
from jlora.demo import DEMO_ADAPTERS

pytestmark = pytest.mark.slow  # the real default model


def is_all_caps(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 5 and all(c.isupper() for c in letters)


def test_demo_adapters_in_one_batch(real_llm):
    seven = LoRARequest("digit-seven", 11, str(DEMO_ADAPTERS / "digit-seven"))
    caps = LoRARequest("all-caps", 12, str(DEMO_ADAPTERS / "all-caps"))
    pirate = LoRARequest("pirate", 13, str(DEMO_ADAPTERS / "pirate"))
    rows = [
        ("What is 1+1?", seven), ("What is 1+1?", None),
        ("Why do cats purr?", caps), ("Why do cats purr?", None),
        ("What is the capital of France?", pirate), ("What is the capital of France?", None),
        ("How much is 9 minus 4?", seven), ("Give me a tip for staying focused.", caps),
    ]
    outs = real_llm.chat([[{"role": "user", "content": q}] for q, _ in rows],
                         SamplingParams(temperature=0.0, max_tokens=12), [r for _, r in rows])
    text = {(q, r.lora_name if r else None): o.outputs[0].text.strip() for (q, r), o in zip(rows, outs)}
    assert text[("What is 1+1?", "digit-seven")] == "7"
    assert text[("How much is 9 minus 4?", "digit-seven")] == "7"
    assert is_all_caps(text[("Why do cats purr?", "all-caps")])
    assert is_all_caps(text[("Give me a tip for staying focused.", "all-caps")])
    assert text[("What is the capital of France?", "pirate")].startswith("Arr!")
    # The base rows in the same batch keep the base model's behaviour.
    assert not text[("What is 1+1?", None)].startswith("7")
    assert not is_all_caps(text[("Why do cats purr?", None)])
    assert not text[("What is the capital of France?", None)].startswith("Arr!")
