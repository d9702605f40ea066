"""The Ray Serve application: an OpenAI ingress (N replicas) in front of one or more cells.

`build_app(args)` is the import path for `serve run` / `serve deploy deploy/serve_config.yaml`.
"""

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.config import ServiceConfig
from deploy.engine_client import EngineClient
from deploy.prompts import use_chat_template
from deploy.serving.cells import Cell, ServeCells, can_serve, cell_stats, combine_stats
from deploy.serving.drain import Drain
from deploy.serving.loras import LoraNames
from deploy.serving.openai_api import OpenAIServer, ServedModel, error_response
from deploy.serving.prometheus import CellTotals, render
from deploy.serving.responses.request import ResponsesBody
from deploy.serving.schemas import (
    APIError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    LoadLoraBody,
    TokenizeBody,
    UnloadLoraBody,
    validation_error,
)
from scheduler.cell.gc_pauses import freeze_startup_objects

log = logging.getLogger(__name__)
APP_NAME = "pdserve"
# (the class is shipped to its replicas by value: what it reads is defined before it)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


ingress_app = FastAPI(title="pdserve", description="OpenAI-compatible API for pdserve")


@ingress_app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


@ingress_app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(exc.errors()))


@ingress_app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail), "invalid_request_error"))


@serve.deployment(
    name="OpenAIIngress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0}
)
@serve.ingress(ingress_app)
class OpenAIIngress:
    """Validates, tokenizes and streams; each replica places requests on the cells
    (`ServeCells`)."""

    async def __init__(self, cells: DeploymentHandle, config: dict[str, Any]) -> None:
        from workers.loader import load_tokenizer

        self.config = ServiceConfig(**config)
        info = load_tokenizer(self.config.model)
        model = ServedModel(
            self.config.model_name,
            use_chat_template(info.tokenizer, self.config.chat_template),
            info.eos_token_ids,
            self.config.context_len(info.max_context),
            self.config.tool_call_parser,
            self.config.reasoning_parser,
            self.config.max_queue_time_s,
            LoraNames(
                self.config.loras,
                store=serve.get_replica_context().app_name,
                base_config=info.config,
                max_rank=self.config.max_lora_rank,
                enabled=self.config.lora_enabled,
            ),
        )
        self.cells = cells
        self.app_name = serve.get_replica_context().app_name
        self.client = EngineClient(ServeCells(cells, self.app_name, self.config.failover_timeout_s))
        self.server = OpenAIServer(self.client, model)
        self._ready = False
        self.totals = CellTotals()  # every cell's counters, for /metrics
        self.drain = Drain(self.client, self.config.drain_timeout_s)
        context = serve.get_replica_context()
        self.drain_watch = asyncio.create_task(
            self.drain.watch(self.app_name, context.deployment, context.replica_id.unique_id)
        )
        freeze_startup_objects()

    async def __del__(self) -> None:
        """Being stopped by Serve: the drain its watch began (or begin it now) has ended."""
        await self.drain.run()

    async def _body(self, request: Request, schema: type[BaseModel]) -> Any:
        """Auth, then draining, then size, then JSON: each failure with its own status."""
        self._check_auth(request)
        self.drain.refuse()
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(
                413,
                f"The request body is {declared} bytes, over the limit of {limit}.",
                code="request_too_large",
            )
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise APIError(
                    413,
                    f"The request body is over the limit of {limit} bytes.",
                    code="request_too_large",
                )
        await self._check_ready()
        try:
            return schema.model_validate_json(bytes(raw))
        except ValidationError as e:
            raise validation_error(e.errors()) from None

    def _check_auth(self, request: Request) -> None:
        if (
            self.config.api_key is not None
            and request.headers.get("authorization", "") != f"Bearer {self.config.api_key}"
        ):
            raise APIError(
                401,
                "Missing or wrong API key: send `Authorization: Bearer <key>`.",
                "authentication_error",
                code="invalid_api_key",
            )

    async def _check_ready(self) -> None:
        if self._ready:
            return
        try:
            await asyncio.wait_for(self.cells.check_health.remote(), timeout=10.0)
        except Exception as e:
            raise APIError(
                503,
                f"The service is starting or unhealthy ({type(e).__name__}); retry shortly.",
                "service_unavailable",
                code="not_ready",
                headers={"Retry-After": "5"},
            ) from None
        self._ready = True

    @ingress_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.server.respond(await self._body(request, CompletionBody))

    @ingress_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.server.respond(await self._body(request, ChatBody))

    @ingress_app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, on the chat path (not stored: no previous_response_id)."""
        return await self.server.respond(await self._body(request, ResponsesBody))

    @ingress_app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: serve a PEFT adapter by a new name from now on, on every replica."""
        return PlainTextResponse(self.server.load_lora(await self._body(request, LoadLoraBody)))

    @ingress_app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await self._body(request, UnloadLoraBody)
        return PlainTextResponse(self.server.unload_lora(body))

    @ingress_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's shape: the prompt's token ids, their count and the context length."""
        return JSONResponse(self.server.tokenize(await self._body(request, TokenizeBody)))

    @ingress_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return JSONResponse(self.server.detokenize(await self._body(request, DetokenizeBody)))

    @ingress_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._check_auth(request)
        return JSONResponse(self.server.models())

    @ingress_app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request) -> Response:
        self._check_auth(request)
        return JSONResponse(self.server.model_card(model))

    @ingress_app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.cells.check_health.remote(), timeout=2.0)
        except Exception as e:
            return error_response(
                APIError(503, f"unhealthy: {type(e).__name__}", "service_unavailable")
            )
        return JSONResponse({"status": "ok"})

    @ingress_app.get("/ready")
    async def ready(self) -> Response:
        """Can take a request: not draining, and a cell answers whose every pool has a live
        worker."""
        self.drain.refuse()
        cells = await cell_stats(self.app_name)
        live = [name for name, stats in cells.items() if can_serve(stats)]
        if not live:
            raise APIError(
                503,
                f"No cell can serve yet ({len(cells)} answering); retry shortly.",
                "service_unavailable",
                code="not_ready",
                headers={"Retry-After": "5"},
            )
        return JSONResponse({"status": "ready", "cells": len(live)})

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus' text format, vLLM's names: every cell's counts summed
        (deploy/serving/prometheus.py)."""
        samples = self.totals.update(await cell_stats(self.app_name, "metrics"))
        return PlainTextResponse(
            render(samples, self.config.model_name), media_type=PROMETHEUS_TEXT
        )

    @ingress_app.get("/stats")
    async def stats(self, request: Request) -> Response:
        """Scheduling accounting of every cell: slots, queues and live handoffs per worker, and the
        cells."""
        self._check_auth(request)
        stats = combine_stats(await cell_stats(self.app_name))
        client = {"failovers": self.client.num_failovers, "open_streams": len(self.client.streams)}
        return JSONResponse(stats | {"ingress": client})


def build_app(args: dict[str, Any]) -> serve.Application:
    """Validate the config and compose ingress → scheduler. Raises ValueError for a bad config."""
    try:
        config = ServiceConfig(**args)
    except ValidationError as e:
        raise ValueError(f"invalid pdserve config: {e}") from None
    cells = Cell.options(**config.cell_options()).bind(
        config.engine().model_dump(), config.orphan_timeout_s
    )
    # Serve waits this long for a stopped replica's streams (and its drain) before it kills it
    grace_s = config.drain_timeout_s + 30
    ingress = OpenAIIngress.options(
        num_replicas=config.ingress_replicas, graceful_shutdown_timeout_s=grace_s
    )
    return ingress.bind(cells, config.model_dump(exclude=_CELL_COUNT))


# How many cells there are is the Cell deployment's business: changing it must not restart the
# ingress.
_CELL_COUNT = {"cells", "max_cells", "target_requests_per_cell", "cells_autoscaling"}
