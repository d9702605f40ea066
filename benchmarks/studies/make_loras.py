"""Random PEFT LoRA adapters of a model, written by PEFT itself, for benchmarking many adapters on
one deployment (docs/BENCHMARKS.md, LoRA adapters). Prints the `--lora-modules` value:

    .venv/bin/python -m benchmarks.studies.make_loras /tmp/loras 8 --rank 16
"""

import argparse
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("count", type=int)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(TARGETS))
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from workers.loader import resolve_checkpoint

    checkpoint = resolve_checkpoint(args.model)
    modules = []
    for i in range(args.count):
        base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        config = LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets.split(",")
        )
        model = get_peft_model(base, config)
        noise = torch.Generator().manual_seed(i)
        with torch.no_grad():  # PEFT starts B at zero: an adapter that changes nothing
            for name, param in model.named_parameters():
                if "lora_" in name:
                    scale = 0.02 / param.shape[-1] ** 0.5
                    param.copy_(torch.randn(param.shape, generator=noise) * scale)
        path = Path(args.directory) / f"lora{i}"
        model.save_pretrained(str(path))
        modules.append(f"lora{i}={path}")
    print(" ".join(modules))


if __name__ == "__main__":
    main()
