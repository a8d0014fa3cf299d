"""``serve_openai``: a Hugging Face model directory served over OpenAI's API by replicas.

What ``python -m actormesh.serve`` runs. The directory is what
``save_pretrained`` writes (``config.json``, ``model.safetensors``, tokenizer
files); nothing is downloaded. The model is built by
:func:`actormesh.parallel.hf.hf_causal_lm` (Llama-family architectures) and
spread over ``tp * pp`` procs per replica.

Example::

    deployment = serve_openai("/models/tiny", replicas=2, tp=2, port=0, block=False)
    print(deployment.url)          # http://127.0.0.1:PORT, OpenAI API under /v1
    deployment.stop()
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

from ._llm_service import LLMService
from ._openai_routes import create_openai_app
from ._openai_server import OpenAIServer


@dataclass
class OpenAIDeployment:
    """A running ``serve_openai``: the HTTP server and the service of replicas behind it."""

    server: OpenAIServer
    llm: LLMService
    model_name: str

    @property
    def url(self) -> str:
        """``http://host:port``; the OpenAI API is under ``/v1``."""
        return self.server.url

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop the HTTP server, then every replica."""
        try:
            self.server.stop(timeout_s)
        finally:
            self.llm.stop(timeout_s)

    def __enter__(self) -> OpenAIDeployment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def load_model_dir(model: str | os.PathLike[str]) -> tuple[Any, Any, list[int]]:
    """``(config, tokenizer, stop_token_ids)`` of a local HF model directory; clear errors if it is not one."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = os.fspath(model)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model {path!r} is not a directory: give a directory written by save_pretrained")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json: give a directory written by model.save_pretrained")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"{path} has no usable tokenizer ({exc}): save one there with tokenizer.save_pretrained") from exc
    stops = set()
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    if os.path.exists(os.path.join(path, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
        stops.update(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    return config, tokenizer, sorted(stops)


def serve_openai(
    model: str | os.PathLike[str],
    *,
    replicas: int = 1,
    tp: int = 1,
    pp: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    max_slots: int = 16,
    max_context: int | None = None,
    ready_timeout_s: float = 600.0,
    block: bool = True,
    **service_options: Any,
) -> OpenAIDeployment | None:
    """Serve the HF model directory ``model`` with OpenAI's API on ``host:port``.

    ``replicas`` replicas of ``tp * pp`` local procs each (``Plan(tp=tp, pp=pp)``)
    run behind a :class:`~actormesh.serve.Service` (least-loaded routing, a dead
    replica rebuilt in the background). ``model_name`` (default: the
    directory's name) is the ``model`` clients must ask for. ``block=True``
    serves until SIGINT/SIGTERM, then stops everything and returns None;
    ``block=False`` returns a running :class:`OpenAIDeployment` at once (after
    the replicas are ready). ``port=0`` picks a free port.
    """
    from ..parallel import Plan
    from ..parallel.hf import hf_causal_lm

    for label, value in (("replicas", replicas), ("tp", tp), ("pp", pp), ("max_slots", max_slots)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an int >= 1, got {value!r}")
    config, tokenizer, stops = load_model_dir(model)
    name = model_name or os.path.basename(os.path.normpath(os.fspath(model)))
    arch = (getattr(config, "architectures", None) or [None])[0]
    model_fn = partial(hf_causal_lm, config.to_dict(), arch)
    server = OpenAIServer(None, host, port)  # bind first: a taken port fails before any proc starts
    llm = LLMService(model_fn, Plan(tp=tp, pp=pp), replicas=replicas, weights=os.fspath(model), max_slots=max_slots,
                     max_context=max_context, **service_options)
    try:
        llm.ready(ready_timeout_s)
        server.set_app(create_openai_app(llm, tokenizer, model_name=name, stop_token_ids=stops, health=llm.healthy))
        if not block:
            server.start()
            return OpenAIDeployment(server, llm, name)
        print(f"actormesh: serving {name!r} at {server.url}/v1 ({replicas} x {tp * pp} procs); Ctrl-C stops",
              file=sys.stderr, flush=True)
        server.serve_forever()
    except BaseException:
        server.close()
        llm.stop()
        raise
    llm.stop()
    return None
