"""The decoding loop: prefill -> { draft -> tree forward -> verify -> commit } until done.

``DecodeSession`` runs one generation step by step (the server streams from it); ``generate`` is
the one-call Python API. A drafter that raises or hands back an invalid or over-budget tree is
replaced by the root-only tree for that step, which is a plain decoding step: output never changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from stree.protocols.drafter import DraftBudget, Drafter, DrafterSession
from stree.protocols.registry import create_drafter
from stree.protocols.sampling import SamplingParams, warp_logits
from stree.protocols.token_tree import DraftMode, TokenTree, TreeBatch

from .model import StreeLM
from .verify import verify_tree

log = logging.getLogger(__name__)

DEFAULT_BUDGET = DraftBudget(max_nodes=64, max_depth=16, max_width=8)


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: dict
    text: Optional[str] = None


@dataclass
class StepTimes:
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tree_problem(tree: TokenTree, root: int, budget: DraftBudget, vocab_size: int) -> Optional[str]:
    """Why a drafted tree can't be verified as is, or None when it can."""
    if not isinstance(tree, TokenTree):
        return f"drafter returned {type(tree).__name__}, not a TokenTree"
    if int(tree.tokens[0]) != root:
        return f"tree root token {int(tree.tokens[0])} is not the current last token {root}"
    if int(tree.tokens.max()) >= vocab_size:
        return f"tree token {int(tree.tokens.max())} is outside the vocabulary of {vocab_size}"
    if tree.draft_probs is not None and tree.draft_probs.shape[1] != vocab_size:
        return f"draft_probs cover {tree.draft_probs.shape[1]} tokens, the target has {vocab_size}"
    return budget.violation(tree)


class DecodeSession:
    """One generation: holds the target state, the drafter session and the tokens emitted so far."""

    def __init__(
        self,
        model: StreeLM,
        prompt_ids: Sequence[int],
        drafter_session: Optional[DrafterSession] = None,
        params: SamplingParams = SamplingParams(),
        budget: DraftBudget = DEFAULT_BUDGET,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] = (),
    ):
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if min(prompt) < 0 or max(prompt) >= model.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {model.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.params = params
        self.budget = budget
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        self.drafter = drafter_session
        self.generator = torch.Generator().manual_seed(
            params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        )
        self.output: list[int] = []
        self.done = False
        self.steps = 0
        self.times = StepTimes()
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.fallbacks = 0
        self.accepted_per_step: list[int] = []
        self.state = model.new_state(1, len(prompt) + max_new_tokens + budget.max_nodes + 2)
        self.started = time.perf_counter()
        if len(prompt) > 1:
            model.prefill(torch.tensor([prompt[:-1]], device=model.device), self.state)
            _sync(model.device)
        self.prefill_s = time.perf_counter() - self.started
        self.root = prompt[-1]

    # ----- one step ---------------------------------------------------------------------------
    def _draft(self) -> TokenTree:
        if self.drafter is None:
            return TokenTree.chain([self.root])
        try:
            tree = self.drafter.draft(self.budget)
            why = tree_problem(tree, self.root, self.budget, self.model.vocab_size)
        except Exception as exc:  # a broken drafter costs speed, never output
            why = f"drafter failed: {exc!r}"
        if why is not None:
            self.fallbacks += 1
            if self.fallbacks <= 3 or self.fallbacks % 100 == 0:  # a dead drafter should not flood the log
                log.warning("drafter skipped for this step (%d so far): %s", self.fallbacks, why)
            return TokenTree.chain([self.root])
        return tree

    def _plain_step(self) -> list[int]:
        """No draft: one ``step`` of the model and a sample from the warped logits."""
        t0 = time.perf_counter()
        logits = self.model.step(torch.tensor([self.root], device=self.model.device), self.state)[0]
        probs = warp_logits(logits, self.params).cpu()
        token = int(probs.argmax()) if self.params.greedy else int(torch.multinomial(probs, 1, generator=self.generator))
        _sync(self.model.device)
        self.times.verify_s += time.perf_counter() - t0
        return [token]

    def _tree_verify(self, tree: TokenTree):
        """Tree forward + verification; returns the new tokens and the pending model commit."""
        dev = self.model.device
        t0 = time.perf_counter()
        logits, acts = self.model.tree_forward(TreeBatch.from_trees([tree]), self.state)
        result = verify_tree(tree, logits[0, : tree.num_nodes], self.params, self.generator)
        self.times.verify_s += time.perf_counter() - t0
        path = result.path
        self.num_draft_tokens += tree.num_nodes - 1
        self.num_accepted_draft_tokens += len(path) - 1
        toks = tree.tokens.tolist()

        def commit() -> None:
            t1 = time.perf_counter()
            self.model.commit(self.state, acts, torch.tensor([path], device=dev), torch.tensor([len(path)], device=dev))
            _sync(dev)
            self.times.commit_s += time.perf_counter() - t1

        return [toks[i] for i in path[1:]] + [result.bonus_token], commit

    def _emit(self, new: list[int]) -> list[int]:
        """Append ``new`` to the output up to the token limit or a stop token; sets ``done``."""
        room = self.max_new_tokens - len(self.output)
        emitted = []
        for tok in new[:room]:
            emitted.append(tok)
            if tok in self.stop_token_ids:
                self.done = True
                break
        self.output.extend(emitted)
        if len(self.output) >= self.max_new_tokens:
            self.done = True
        return emitted

    def _commit_drafter(self, new: list[int]) -> None:
        t1 = time.perf_counter()
        try:
            self.drafter.commit(new)
        except Exception as exc:
            log.warning("drafter commit failed (%r); continuing without the drafter", exc)
            self.drafter = _DeadDrafter()
        self.times.draft_s += time.perf_counter() - t1

    def step(self) -> list[int]:
        """Run one draft-verify-commit step; returns the tokens it emitted (empty once done).

        The drafter hears the accepted tokens before the target's commit replay runs, so a
        remote drafter drafts the next tree while the GPU replays.
        """
        if self.done:
            return []
        t0 = time.perf_counter()
        tree = self._draft()
        self.times.draft_s += time.perf_counter() - t0
        if self.drafter is None:
            new, commit = self._plain_step(), None
        else:
            new, commit = self._tree_verify(tree)
        self.steps += 1
        self.accepted_per_step.append(len(new))
        emitted = self._emit(new)
        if self.drafter is not None and not self.done:
            self._commit_drafter(new)
        if commit is not None and not self.done:
            commit()
        self.root = new[-1]
        return emitted

    def run(self) -> list[int]:
        while not self.done:
            self.step()
        return self.output

    def close(self) -> None:
        if self.drafter is not None:
            try:
                self.drafter.close()
            except Exception as exc:
                log.warning("drafter close failed: %r", exc)
        self.drafter = None

    @property
    def stats(self) -> dict:
        elapsed = time.perf_counter() - self.started
        n = len(self.output)
        return {
            "steps": self.steps,
            "new_tokens": n,
            "mean_accepted_length": (sum(self.accepted_per_step) / self.steps) if self.steps else 0.0,
            "tokens_per_s": n / elapsed if elapsed > 0 else 0.0,
            "decode_tokens_per_s": n / (elapsed - self.prefill_s) if elapsed > self.prefill_s else 0.0,
            "elapsed_s": elapsed,
            "prefill_s": self.prefill_s,
            "draft_s": self.times.draft_s,
            "verify_s": self.times.verify_s,
            "commit_s": self.times.commit_s,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "drafter_fallbacks": self.fallbacks,
        }


class _DeadDrafter:
    """Stands in for a drafter that failed for good: always the empty draft."""

    def draft(self, budget):
        raise RuntimeError("drafter is gone")

    def commit(self, tokens):
        return None

    def close(self):
        return None


def open_drafter(
    drafter: Union[None, str, Drafter],
    prompt_ids: Sequence[int],
    params: SamplingParams,
    draft_model: Optional[StreeLM] = None,
    **options,
) -> Optional[DrafterSession]:
    """A drafter session from a name, a ``Drafter`` object, or None/'none' for plain decoding."""
    if drafter is None or drafter == "none":
        return None
    if isinstance(drafter, str):
        opts = {k: v for k, v in options.items() if v is not None}
        if draft_model is not None:
            opts["draft_model"] = draft_model
        drafter = create_drafter(drafter, **opts)
    if not hasattr(drafter, "open"):
        raise ValueError(f"drafter must be a name or a Drafter, got {type(drafter).__name__}")
    return drafter.open(list(prompt_ids), params)


def generate(
    model: StreeLM,
    prompt_ids: Sequence[int],
    drafter: Union[None, str, Drafter] = None,
    draft_model: Optional[StreeLM] = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    budget: Optional[DraftBudget] = None,
    stop_token_ids: Sequence[int] = (),
    tokenizer=None,
    cuda_graphs: Optional[bool] = None,
    **drafter_options,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; speculation never changes the output's distribution.

    On CUDA the target's step, verify pass and commit replay CUDA graphs unless ``cuda_graphs=False``.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.reshape(-1).tolist()
    if draft_model is not None and draft_model.vocab_size != model.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({draft_model.vocab_size}) differs from the target's ({model.vocab_size})"
        )
    budget = budget or DEFAULT_BUDGET
    if cuda_graphs is None:
        cuda_graphs = model.device.type == "cuda"
    if cuda_graphs:
        from .cuda_graphs import graphed

        model = graphed(model, len(prompt_ids) + max_new_tokens + budget.max_nodes + 2)
    session = open_drafter(drafter, prompt_ids, params, draft_model=draft_model, **drafter_options)
    dec = DecodeSession(model, prompt_ids, session, params, budget, max_new_tokens,
                        stop_token_ids)
    try:
        dec.run()
    finally:
        dec.close()
    text = tokenizer.decode(dec.output) if tokenizer is not None else None
    return GenerationResult(token_ids=dec.output, stats=dec.stats, text=text)


__all__ = ["DecodeSession", "GenerationResult", "generate", "open_drafter", "tree_problem", "DraftMode"]
