"""Scale-out on Ray Serve: one verifier replica per GPU, each the OpenAI HTTP app on its own engine.

Ray Serve's proxy spreads requests over the replicas. Drafting stays in each replica (in-process
drafters) or goes to a DrafterService whose drafters are the Ray actor pools of
``drafter_service.actors`` (``drafter="grpc://HOST:PORT/NAME"``; ``draft_ahead=N`` lets that service draft up to N
trees ahead while each tree is verified, as ``stree serve --draft-ahead``). ``app_builder`` is the import path
for ``serve run`` and the KubeRay RayService manifest (deploy/kuberay/rayservice.yaml).
"""

from __future__ import annotations

import os
from typing import Optional

from ray import serve

REPLICA_HEADER = b"x-stree-replica"


def _with_replica_header(app, replica: str):
    """ASGI middleware: every response names the replica that served it."""

    async def wrapped(scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + [(REPLICA_HEADER,
                                                                                       replica.encode())]}
            await send(message)

        await app(scope, receive, tagged)

    return wrapped


def check_draft_ahead(drafter: str, draft_ahead) -> int:
    """``draft_ahead`` when it fits ``drafter``, else ``ValueError`` naming it: a whole number from 0 to
    ``MAX_OVERLAP``, and above 0 only for a remote drafter."""
    from stree.verifier.service.remote_drafter import MAX_OVERLAP

    if isinstance(draft_ahead, bool) or not isinstance(draft_ahead, int) or not 0 <= draft_ahead <= MAX_OVERLAP:
        raise ValueError(f"draft_ahead must be a whole number from 0 to {MAX_OVERLAP}, got {draft_ahead!r}")
    if draft_ahead and not drafter.startswith("grpc://"):
        raise ValueError(f"draft_ahead is for a remote drafter (grpc://HOST:PORT/NAME), not {drafter!r}")
    return draft_ahead


@serve.ingress()
class VerifierReplica:
    """Loads the model and serves the OpenAI-compatible API from this replica's engine."""

    def __init__(self, model_dir: str, served_model_name: Optional[str] = None, drafter: str = "none",
                 draft_model: Optional[str] = None, limits: Optional[dict] = None, device: Optional[str] = None,
                 draft_ahead: int = 0, dtype: Optional[str] = None):
        import torch

        from stree.verifier.model.checkpoint import load_model
        from stree.verifier.model.hub import ModelFolder, resolve_model_dir
        from stree.verifier.model.lm import weights_dtype
        from stree.verifier.model.tokenizer import eos_token_id, load_tokenizer
        from stree.verifier.service.chat_template import ChatTemplate
        from stree.verifier.service.core import ServerLimits, ServingCore
        from stree.verifier.service.drafters import EmbeddedDrafters, RemoteDrafters
        from stree.verifier.service.metrics import ServerMetrics
        from stree.verifier.service.openai_api import OpenAIApp

        check_draft_ahead(drafter, draft_ahead)
        weights = weights_dtype(dtype)  # None: the checkpoint's own dtype
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model_dir = ModelFolder(resolve_model_dir(model_dir), model_dir)  # a folder or a Hugging Face Hub id
        model = load_model(model_dir, device=device, dtype=weights)
        tokenizer = load_tokenizer(model_dir)
        lim = ServerLimits(**(limits or {}))
        if drafter.startswith("grpc://"):
            drafters = RemoteDrafters(drafter, 0.05, lim.budget, overlap=draft_ahead)
        else:
            draft = load_model(draft_model, device=device, dtype=weights) if draft_model else None
            drafters = EmbeddedDrafters(drafter, draft_model=draft)
        name = served_model_name or model_dir.display_name
        core = ServingCore(model, tokenizer, drafters, lim, ServerMetrics(name), eos_token_id(tokenizer))
        self.replica = f"{os.getpid()}-{serve.get_replica_context().replica_tag}"
        self.asgi = _with_replica_header(OpenAIApp(core, name, ChatTemplate.from_model_dir(model_dir)).app,
                                        self.replica)

    def __serve_build_asgi_app__(self):
        return self.asgi


def verifier_deployment(num_replicas: int = 1, gpus_per_replica: float = 1.0):
    """The replica class as a Serve deployment: ``num_replicas`` copies, each holding ``gpus_per_replica``."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return serve.deployment(VerifierReplica, name="stree-verifier", num_replicas=num_replicas,
                            ray_actor_options={"num_gpus": gpus_per_replica},
                            max_ongoing_requests=1024)


def app_builder(args: dict):
    """``serve run stree.verifier.service.ray_serve:app_builder model_dir=... num_replicas=...``."""
    args = dict(args)
    model_dir = args.pop("model_dir", None)
    if not model_dir:
        raise ValueError("app_builder needs model_dir")
    replicas = int(args.pop("num_replicas", 1))
    gpus = float(args.pop("gpus_per_replica", 1.0))
    limits = args.pop("limits", None)
    from stree.verifier.model.lm import weights_dtype

    weights_dtype(args.get("dtype"))  # a name it does not know is refused before any replica starts
    if "draft_ahead" in args:  # ``serve run ... draft_ahead=4`` passes text
        try:
            args["draft_ahead"] = int(args["draft_ahead"])
        except (TypeError, ValueError):
            raise ValueError(f"draft_ahead must be a whole number, got {args['draft_ahead']!r}") from None
        check_draft_ahead(args.get("drafter", "none"), args["draft_ahead"])
    return verifier_deployment(replicas, gpus).bind(model_dir, limits=limits, **args)
