import os

# Tests run on the CPU; keep XLA from grabbing both cores for its own thread pool twice.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
