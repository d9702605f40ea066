"""The configuration: the engine's (shared by the CLI, the batch job and the Serve app) and the
service's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from deploy.prompts import read_chat_template
from scheduler.cell.state import MODES_ON_RAY, CellConfig
from scheduler.request import LoraRef
from scheduler.speculation import SpeculativeConfig
from workers.catalog import ALIASES, DEFAULT_MODEL, MAX_DEFAULT_CONTEXT

Mode = Literal["local", "colocated", "disaggregated"]
MODES: tuple[str, ...] = get_args(Mode)
# the readers of tool calls in generated text (deploy/serving/tools/call_readers.py)
ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic"]
# the readers of `<think>` parts (deploy/serving/reasoning.py)
ReasoningParser = Literal["qwen3", "deepseek_r1"]
REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParser)
# weights kept packed (workers/quantized.py): a GGUF's own blocks, or int8 made at load
Quantization = Literal["gguf", "int8", "fp8"]
# how KV goes from prefill to decode workers (workers/kv_transfer.py)
KVTransport = Literal["auto", "object_store", "nixl", "cuda_ipc"]
# the cells' autoscaling policy, as Serve's controller imports it (by name: config imports no
# serving code)
AUTOSCALING_POLICY = "deploy.serving.autoscaling:open_requests"
assert set(MODES_ON_RAY) < set(MODES)


class EngineConfig(BaseModel):
    """How to load the model and how to schedule it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        DEFAULT_MODEL, description="Alias, checkpoint directory, .gguf file or hub id."
    )
    mode: Mode = Field(
        "local",
        description="local: one process, no Ray; colocated: prefill and decode in "
        "the same Ray workers; disaggregated: separate prefill and decode worker pools.",
    )
    slots: int = Field(
        16,
        ge=1,
        validation_alias=AliasChoices("slots", "max_num_seqs"),
        description="Requests one worker runs at once (vLLM's --max-num-seqs, which is the same "
        "flag here).",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Tokens per request (prompt + output); default: "
        f"the model's context, capped at {MAX_DEFAULT_CONTEXT}.",
    )
    kv_cache_memory: str | int | None = Field(
        None,
        description="KV cache per worker: bytes, or a size such as 2GiB or 512MiB; its blocks are "
        "shared by every request the worker holds. Default: room for `slots` (`prefill_slots` on "
        "a prefill worker) requests of max_model_len, plus prefix_cache_tokens.",
    )
    block_size: int = Field(
        16, ge=1, le=1024, description="Tokens per KV block (the unit of the cache and of sharing)."
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="auto (the model's dtype); int8 or fp8 (e4m3): a byte a value, a scale a row",
    )
    token_budget: int = Field(
        256, ge=1, description="Tokens computed per step: decode tokens first, then prompt chunks."
    )
    speculative_config: str | dict[str, Any] | None = Field(
        None,
        description="Speculative decoding, as vLLM's flag: JSON such as "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (also prompt_lookup_min, '
        'prompt_lookup_max, disable_by_batch_size), or \'{"method": "draft_model", "model": '
        '"<draft>"}\' (also its "quantization"). Unset: off.',
    )
    prefill_chunk: int = Field(
        128, ge=1, description="Most prompt tokens of one request in one step."
    )
    max_waiting: int | None = Field(
        None, ge=0, description="Waiting requests before new ones are rejected; unbounded if unset."
    )
    dtype: str = Field(
        "auto", description="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16."
    )
    device: str = Field("auto", description="auto, cpu or cuda.")
    quantization: Quantization | None = Field(
        None,
        description="Weights kept quantized and multiplied packed (vLLM's --quantization): gguf "
        "serves a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks as they are; int8 quantizes "
        "any float checkpoint at load, per output channel; fp8 (GPU only) to FP8 e4m3 per output "
        "channel. Unset: weights dequantized to dtype (a GPTQ, AWQ or compressed-tensors "
        "checkpoint is served packed as it is).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks per worker (vLLM's --tensor-parallel-size): each holds its share of the "
        "heads (by KV group, as evenly as they go), MLP columns and vocabulary, and its KV heads' "
        "pool; ranks 1.. are Ray actors on rank 0's node, gloo on CPUs, NCCL on GPUs. Not yet "
        "with a GGUF's blocks (--quantization gguf), a draft model or LoRA.",
    )
    prefill_tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="Disaggregated mode: ranks per prefill worker; default: tensor_parallel_size.",
    )
    decode_tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="Disaggregated mode: ranks per decode worker; default: tensor_parallel_size.",
    )
    lora_modules: list[str] | dict[str, str] | None = Field(
        None,
        description="LoRA adapters served beside the model (vLLM's --lora-modules): name=path "
        "..., each a PEFT checkpoint (adapter_config.json, adapter_model.safetensors) every "
        "worker can read; a request picks one by its `model`. A mapping in the Serve config.",
    )
    enable_lora: bool = Field(
        False, description="Serve LoRA adapters (on whenever lora_modules names some)."
    )
    max_loras: int = Field(
        4,
        ge=1,
        description="LoRA adapters one worker runs (and holds) at once: a request of another "
        "waits for one of them to finish.",
    )
    max_lora_rank: int = Field(
        16, ge=1, description="The highest LoRA rank served; an adapter above it is refused."
    )
    lora_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="The dtype workers hold LoRA adapters in: auto (the model's); bfloat16 halves "
        "an fp32 model's adapter bytes, which a step mixing many adapters reads (lossless for "
        "adapters saved in bf16; the updates are computed in fp32 either way).",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly (vLLM's --enforce-eager). Otherwise, on a GPU, decode "
        "steps replay CUDA graphs captured at start-up, one per batch-size bucket "
        "(`workers/decode_graphs.py`); CPU workers always run eagerly.",
    )
    prefill_workers: int = Field(1, ge=1, description="Prefill worker actors (disaggregated mode).")
    decode_workers: int = Field(
        1, ge=1, description="Decode worker actors (disaggregated and colocated)."
    )
    local_prefill_max_tokens: int = Field(
        0,
        ge=0,
        description="Prompts shorter than this are prefilled on "
        "the decode worker, skipping the handoff; 0 always hands off.",
    )
    prefill_slots: int = Field(
        16,
        ge=1,
        description="Prompts one prefill worker can hold "
        "partly prefilled at once. Short prompts need many (a step takes up to "
        "token_budget tokens of them); long ones are bounded by the token budget.",
    )
    prefill_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each "
        'prefill worker needs, e.g. {"prefill_node": 1} (cluster.yaml).',
    )
    decode_resources: dict[str, float] = Field(
        default_factory=dict,
        description='Custom Ray resources each decode worker needs, e.g. {"decode_node": 1}.',
    )
    max_preemptions: int = Field(
        2,
        ge=0,
        description="Times one request may be preempted for more urgent ones; "
        "after that it is not preemptible, so it cannot starve.",
    )
    max_worker_restarts: int = Field(3, ge=0, description="Times Ray restarts a dead worker actor.")
    max_recomputes: int = Field(
        3,
        ge=0,
        description="Times one request's lost cache is recomputed before it ends with an error.",
    )
    num_cpus_per_worker: float = Field(
        1.0, gt=0, description="CPUs reserved per worker actor; torch uses that many threads."
    )
    gpus_per_worker: float | None = Field(
        None,
        ge=0,
        description="GPUs each worker actor takes; default: 1 where the cluster has GPUs, else 0. "
        "0.5 lets a prefill and a decode worker share one GPU.",
    )
    kv_transport: KVTransport = Field(
        "auto",
        description="How prompts' KV goes from prefill to decode workers: object_store (Ray's "
        "shared memory), nixl (Ray Direct Transport over NIXL: GPU or host memory, across nodes), "
        "cuda_ipc (a prefill and a decode worker sharing one GPU); auto: cuda_ipc where every "
        "decode worker shares the prefill worker's GPU, else nixl for GPU KV where NIXL is "
        "installed, else object_store. One that cannot serve every pair fails at start.",
    )
    kv_transfer_failure: Literal["recompute", "fail"] = Field(
        "recompute",
        description="A handoff whose KV cannot be fetched (its prefill worker died, the transfer "
        "failed or timed out): recompute the request from its tokens, or end it with an error.",
    )
    pool_planner: bool = Field(
        False,
        description="Disaggregated mode: every planner_window_s, move a worker between the "
        "prefill and decode pools when the measured load needs it (the pools keep their devices; "
        "with two tensor-parallel sizes, whole workers holding as many devices move, e.g. two "
        "prefill workers of one rank for one decode worker of two).",
    )
    planner_slo_itl_ms: float = Field(
        50.0,
        gt=0,
        description="The inter-token latency the pool planner sizes decode batches for.",
    )
    planner_slo_ttft_ms: float = Field(
        2000.0,
        gt=0,
        description="The time to first token the pool planner defends: when a window's p90 "
        "passes it and the load needs more prefill workers, it moves one at once.",
    )
    planner_window_s: float = Field(
        10.0, gt=0, description="The pool planner's window: how often it looks at the load."
    )
    max_prefill_workers: int | None = Field(
        None,
        ge=1,
        description="With pool_planner: the planner also starts prefill workers up to this many "
        "(on free resources) and releases idle ones down to one; unset: role changes only.",
    )
    max_decode_workers: int | None = Field(None, ge=1, description="Likewise for the decode pool.")
    planner_release_delay_s: float = Field(
        30.0,
        ge=0,
        description="With max_prefill_workers or max_decode_workers: a worker is released only "
        "when the load has needed fewer for this long (Ray Serve's downscale_delay_s); about a "
        "worker's start-up, so one released on a dip is not needed again before it could start.",
    )
    planner_period_s: float | None = Field(
        None,
        gt=0,
        description="With max_prefill_workers or max_decode_workers: the load repeats with this "
        "period (86400: daily); once a period is seen, the planner sizes the pools a start-up "
        "ahead by what the same time of the last period needed, at today's level.",
    )
    prefix_cache_tokens: int = Field(
        16384,
        ge=0,
        description="Prefix caching: full KV blocks stay named by their tokens and are shared by "
        "later requests with the same prefix; 0 turns it off. Without kv_cache_memory, the "
        "cache holds this many tokens beyond the requests' own.",
    )
    cache_routing: bool = Field(
        True,
        description="Send each prompt to the worker where the most of its prefix "
        "is cached, weighed against queued work; false: by load only.",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template, or a file holding one, for chat "
        "requests instead of the model's own (e.g. one that shows tools).",
    )
    max_burst_ms: float = Field(
        20.0,
        ge=0,
        description="Ray modes: while a decode worker only decodes, one "
        "call to it carries several steps, up to this many milliseconds of them, so "
        "Ray's per-call cost (about a millisecond) is paid once for several tokens; "
        "0: one step per call.",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.prefill_chunk > self.token_budget:
            raise ValueError(
                f"prefill_chunk ({self.prefill_chunk}) must not exceed token_budget "
                f"({self.token_budget}): a chunk larger than a step's budget never runs whole"
            )
        gguf = self.model in ALIASES or self.model.endswith(".gguf")
        if self.quantization == "gguf" and not gguf:
            raise ValueError(
                f"quantization gguf serves a GGUF file's blocks: {self.model!r} is neither a .gguf "
                f"file nor a GGUF alias ({', '.join(ALIASES)}); use int8 for other checkpoints"
            )
        self._check_tensor_parallel()
        scaling = self.max_prefill_workers is not None or self.max_decode_workers is not None
        if self.planner_period_s is not None and not (self.pool_planner and scaling):
            raise ValueError(
                "planner_period_s sizes pools that scale: set pool_planner and "
                "max_prefill_workers or max_decode_workers too"
            )
        return self

    def _check_tensor_parallel(self) -> None:
        """What tensor-parallel workers cannot serve yet, refused before anything starts."""
        per_pool = (self.prefill_tensor_parallel_size, self.decode_tensor_parallel_size)
        if self.mode != "disaggregated" and per_pool != (None, None):
            raise ValueError(
                "prefill_tensor_parallel_size and decode_tensor_parallel_size size the pools of "
                "disaggregated mode; use tensor_parallel_size"
            )
        sizes = {kind: self.tp_size(kind) for kind in ("prefill", "decode")}
        if max(sizes.values()) == 1:
            return
        tp = f"tensor_parallel_size {max(sizes.values())}"
        speculative = self.speculative
        unserved = {
            "quantization gguf (use int8)": self.quantization == "gguf",
            # the draft model runs on rank 0 alone; its drafts would have to reach the others
            "a draft model (use the ngram method)": speculative is not None
            and speculative.method == "draft_model",
            "LoRA adapters": self.enable_lora or bool(self.lora_modules),
        }
        for name, given in unserved.items():
            if given:
                raise ValueError(f"{tp}: {name} is not served tensor-parallel yet")

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, value: list[str] | dict[str, str] | None) -> dict[str, str] | None:
        if value is None or isinstance(value, dict):
            return value
        modules = {}
        for item in value:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {item!r} is not name=path")
            if name in modules:
                raise ValueError(f"lora_modules: {name!r} is named twice")
            modules[name] = path
        return modules

    @property
    def loras(self) -> dict[str, LoraRef]:
        """The adapters of lora_modules, by name."""
        modules = self.lora_modules or {}
        assert isinstance(modules, dict)
        return {name: LoraRef(name, path) for name, path in modules.items()}

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, value: str | dict[str, Any] | None) -> dict[str, Any] | None:
        """A JSON object (the flag's text) or a mapping (the Serve config's), checked whole."""
        if value is None:
            return None
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from e
            if not isinstance(value, dict):
                raise ValueError("speculative_config must be a JSON object")
        SpeculativeConfig.from_dict(value)  # raises ValueError with the reason
        return value

    @property
    def speculative(self) -> SpeculativeConfig | None:
        config = self.speculative_config
        return None if config is None else SpeculativeConfig.from_dict(dict(config))

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory_size(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            parse_size(value)  # raises ValueError naming the value
        return value

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        """A file is read here, once: the config carries the template itself to every process and
        node (a missing file fails at start, not on the first chat)."""
        return None if value is None else read_chat_template(value)

    def num_workers(self) -> int:
        """Worker actors the engine runs (none in local mode)."""
        if self.mode == "local":
            return 0
        return self.decode_workers + (self.prefill_workers if self.mode == "disaggregated" else 0)

    def tp_size(self, kind: str) -> int:
        """Ranks per worker of the pool `kind` ("prefill" or "decode")."""
        size = self.prefill_tensor_parallel_size if kind == "prefill" else None
        size = self.decode_tensor_parallel_size if kind == "decode" else size
        return size or self.tensor_parallel_size

    def num_ranks(self) -> int:
        """Processes holding a share of the model: every worker's tensor-parallel ranks (in local
        mode, the engine's own)."""
        if self.mode == "local":
            return self.tensor_parallel_size
        prefill = self.prefill_workers if self.mode == "disaggregated" else 0
        return prefill * self.tp_size("prefill") + self.decode_workers * self.tp_size("decode")

    def worker_threads(self) -> int:
        """The torch threads each worker actor uses: one per whole CPU it reserves, at least one."""
        return max(1, int(self.num_cpus_per_worker))

    def context_len(self, model_context: int) -> int:
        """Slot capacity: max_model_len if set (never over the model's context), else the model's
        context capped at MAX_DEFAULT_CONTEXT."""
        if self.max_model_len is None:
            return min(model_context, MAX_DEFAULT_CONTEXT)
        if self.max_model_len > model_context:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context of {model_context}"
            )
        return self.max_model_len

    def gpus_for(self, cluster_gpus: float) -> float:
        """GPUs each worker takes on a cluster with `cluster_gpus`. Raises ValueError, with the
        numbers, when one cell's workers ask for more than the cluster has: Ray would otherwise
        wait forever for the worker that does not fit."""
        per_worker = self.gpus_per_worker
        if per_worker is None:
            per_worker = 1.0 if cluster_gpus >= 1 else 0.0
        # each tensor-parallel rank of a worker takes the worker's GPUs (local mode: not counted)
        ranks = 0 if self.mode == "local" else self.num_ranks()
        needed = per_worker * ranks
        if needed > cluster_gpus:
            what = "workers" if ranks == self.num_workers() else "worker ranks"
            raise ValueError(
                f"{ranks} {what} of {per_worker:g} GPU each need {needed:g} GPUs, "
                f"the cluster has {cluster_gpus:g}: lower the workers, or set gpus_per_worker "
                f"(e.g. {cluster_gpus / ranks:g}) so that they share"
            )
        return per_worker

    def check_tp_groups(self, nodes: list[dict[str, float]], gpus_per_rank: float) -> None:
        """Raises ValueError, with what is lacking, when no node of `nodes` (each node's Ray
        resources) can hold one worker's tensor-parallel ranks: they are pinned to their rank 0's
        node (`workers/tp_group.py`), so Ray would otherwise wait forever for the last of them."""
        if self.mode == "local":
            return
        pools = ["decode"] + (["prefill"] if self.mode == "disaggregated" else [])
        for kind in pools:
            size = self.tp_size(kind)
            need = {"CPU": size * self.num_cpus_per_worker, "GPU": size * gpus_per_rank}
            need = {name: amount for name, amount in need.items() if amount > 0}
            if size == 1 or any(
                all(node.get(name, 0.0) >= amount for name, amount in need.items())
                for node in nodes
            ):
                continue
            largest = {name: max((n.get(name, 0.0) for n in nodes), default=0.0) for name in need}
            raise ValueError(
                f"a {kind} worker of tensor-parallel size {size} needs "
                f"{_amounts(need)} on one node (its ranks run beside its rank 0), and the "
                f"largest node has {_amounts(largest)}: lower the {kind} tensor-parallel size "
                "or num_cpus_per_worker/gpus_per_worker, or add a larger node"
            )

    def num_blocks(self, capacity: int, slots: int, bytes_per_token: int) -> int:
        """KV blocks of one worker running `slots` requests of at most `capacity` tokens each, K
        and V taking `bytes_per_token`: `kv_cache_memory` of them, or by default what `slots`
        whole contexts and `prefix_cache_tokens` need. Raises ValueError if the blocks cannot hold
        one request of `capacity` tokens."""
        if self.kv_cache_memory is None:
            per_request = -(-capacity // self.block_size)
            return slots * per_request + self.prefix_cache_tokens // self.block_size
        size = parse_size(self.kv_cache_memory)
        blocks = size // (bytes_per_token * self.block_size)
        if blocks * self.block_size < capacity:
            raise ValueError(
                f"kv_cache_memory {self.kv_cache_memory} holds {blocks * self.block_size} tokens "
                f"({bytes_per_token} bytes each), fewer than one request of max_model_len "
                f"{capacity} needs: give more memory or lower max_model_len"
            )
        return blocks

    @property
    def prefix_caching(self) -> bool:
        return self.prefix_cache_tokens > 0

    def cell_config(self, capacity: int, bytes_per_token: int) -> CellConfig:
        """The scheduler cell of a Ray mode, with requests of at most `capacity` tokens whose KV
        takes `bytes_per_token`."""
        return CellConfig(
            mode=self.mode,
            num_decode_workers=self.decode_workers,
            num_prefill_workers=self.prefill_workers,
            decode_slots=self.slots,
            prefill_slots=self.prefill_slots,
            capacity=capacity,
            token_budget=self.token_budget,
            prefill_chunk=self.prefill_chunk,
            max_waiting=self.max_waiting,
            max_preemptions=self.max_preemptions,
            max_recomputes=self.max_recomputes,
            local_prefill_max_tokens=self.local_prefill_max_tokens,
            decode_blocks=self.num_blocks(capacity, self.slots, bytes_per_token),
            prefill_blocks=self.num_blocks(capacity, self.prefill_slots, bytes_per_token),
            block_size=self.block_size,
            prefix_caching=self.prefix_caching,
            speculative=self.speculative,
            max_loras=self.max_loras if self.lora_enabled else None,
            cache_routing=self.cache_routing,
            max_burst_ms=self.max_burst_ms,
            kv_transfer_failure=self.kv_transfer_failure,
            pool_planner=self.pool_planner,
            slo_itl_ms=self.planner_slo_itl_ms,
            slo_ttft_ms=self.planner_slo_ttft_ms,
            planner_window_s=self.planner_window_s,
            prefill_tensor_parallel_size=self.tp_size("prefill"),
            decode_tensor_parallel_size=self.tp_size("decode"),
            max_prefill_workers=self.max_prefill_workers,
            max_decode_workers=self.max_decode_workers,
            planner_release_delay_s=self.planner_release_delay_s,
            planner_period_s=self.planner_period_s,
        )


def parse_size(value: str | int) -> int:
    """Bytes of a size: an integer, or a number with a unit (KiB, MiB, GiB, TiB; KB, MB, GB, TB;
    B). Raises ValueError naming the value."""
    if isinstance(value, int):
        size = value
    else:
        units = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
        units |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
        units |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
        text = value.strip().lower().replace(" ", "")
        number = text.rstrip("kmgtib")
        unit = text[len(number) :]
        try:
            size = int(float(number) * units[unit])
        except (KeyError, ValueError):
            raise ValueError(
                f"kv_cache_memory {value!r} is not a size: give bytes or a number with a unit, "
                "such as 2GiB or 512MiB"
            ) from None
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return size


def format_validation_errors(
    errors: Sequence[Any], skip: tuple[str, ...] = (), limit: int = 5, whole: str = "body"
) -> str:
    """pydantic's errors as `where: what; ...` (the first `limit`; `whole` names an error of the
    whole object), for a 400 or a bad input line. Parts of a location in `skip` are left out."""

    def where(error: Any) -> str:
        return ".".join(str(p) for p in error.get("loc", ()) if p not in skip)

    return "; ".join(f"{where(e) or whole}: {e.get('msg')}" for e in list(errors)[:limit])


class ReplyConfig(EngineConfig):
    """The engine plus how OpenAI replies name the model and read its text: the HTTP edge's and the
    batch job's (its OpenAI batch lines)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str | None = Field(
        None, description="The `model` clients send; default: --model."
    )
    tool_call_parser: ToolCallParser | None = Field(
        None,
        description="Reads the tool calls of tool_choice auto "
        "out of the text: hermes (<tool_call> blocks: Qwen2.5/3, Hermes), "
        "llama3_json (Llama 3.1/3.2), mistral, pythonic (Llama 3.2/4's "
        "[f(x=1)] lists); unset: auto is refused.",
    )
    reasoning_parser: ReasoningParser | None = Field(
        None,
        description="Returns a reasoning model's <think> part "
        "as reasoning_content (qwen3: when the reply opens with "
        "<think>; deepseek_r1: the reply starts inside it).",
    )

    def engine(self) -> EngineConfig:
        fields = set(EngineConfig.model_fields)
        return EngineConfig(**{k: v for k, v in self.model_dump().items() if k in fields})

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class ServiceConfig(ReplyConfig):
    """The service: the engine plus what the HTTP edge needs. `serve_config.yaml`'s `args` are
    these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: str = Field(
        "disaggregated", description="colocated or disaggregated (local runs without Ray)."
    )
    ingress_replicas: int = Field(1, ge=1, description="Replicas of the HTTP ingress deployment.")
    api_key: str | None = Field(
        None, description="If set, requests need `Authorization: Bearer <key>`."
    )
    max_request_bytes: int = Field(1_000_000, ge=1024, description="Larger request bodies get 413.")
    cells: int = Field(
        1,
        ge=1,
        description="Cells (a scheduler with its own prefill and decode workers); the "
        "minimum when max_cells is set.",
    )
    max_cells: int | None = Field(
        None,
        ge=1,
        description="Scale cells with load up to this many (Serve "
        "autoscaling); unset: a fixed number of cells.",
    )
    target_requests_per_cell: int | None = Field(
        None,
        ge=1,
        description="Open requests per cell that "
        "autoscaling aims at (default: the decode slots of a cell).",
    )
    cells_autoscaling: dict[str, Any] = Field(
        default_factory=dict,
        description="More of Serve's "
        "autoscaling_config for the cells (e.g. upscale_delay_s, default "
        "5; downscale_delay_s, default 60).",
    )
    failover_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long a stream whose cell died waits for "
        "another cell before it ends with an error.",
    )
    orphan_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A cell's scheduler that no Cell replica has adopted for this long, with no "
        "request open, stops itself and its workers (its app was deleted while its replica was "
        "dead; a dead replica's replacement adopts it within seconds).",
    )
    max_queue_time_s: float | None = Field(
        None,
        gt=0,
        description="A request not given a slot this many seconds after it arrived gets 503 "
        "with Retry-After, its state freed; unset: it waits as long as it takes.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM (or Ctrl-C) the ingress turns not-ready and refuses new "
        "requests with 503; its open streams may finish for this long, then end with an error "
        "event.",
    )

    @model_validator(mode="after")
    def _serving_mode(self) -> ServiceConfig:
        if self.mode not in MODES_ON_RAY:
            raise ValueError(
                f"mode {self.mode!r} cannot be served: use {' or '.join(MODES_ON_RAY)} "
                "(local mode runs in one process, without Ray)"
            )
        if self.max_cells is not None and self.max_cells < self.cells:
            raise ValueError(f"max_cells ({self.max_cells}) must be at least cells ({self.cells})")
        return self

    def num_workers(self) -> int:
        return super().num_workers() * (self.max_cells or self.cells)

    def cell_options(self) -> dict[str, Any]:
        """The Cell deployment's replica count, or its autoscaling between cells and max_cells on
        the cells' open requests (deploy/serving/autoscaling.py)."""
        if self.max_cells is None or self.max_cells == self.cells:
            return {"num_replicas": self.cells}
        target = self.target_requests_per_cell or self.slots * self.decode_workers
        return {
            "autoscaling_config": {
                "upscale_delay_s": 5.0,
                "downscale_delay_s": 60.0,
                **self.cells_autoscaling,
                "min_replicas": self.cells,
                "max_replicas": self.max_cells,
                "target_ongoing_requests": target,
                "policy": {"policy_function": AUTOSCALING_POLICY},
            }
        }


def _amounts(resources: dict[str, float]) -> str:
    return " and ".join(f"{amount:g} {name}" for name, amount in resources.items())
