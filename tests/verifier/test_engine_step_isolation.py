"""One sequence can never fail the others: a step that raises because of one request ends only that request.

The failures are forced on purpose: a device drafter that raises when a poison token is among the step's roots
(the failure comes before any state moved, so the engine finds the culprit and the others take their step), a
model whose prefill raises on a poison prompt (the others join), and a drafter commit that raises after the target
moved (then every running sequence ends with an error, and nothing is emitted twice).
"""

from __future__ import annotations

import pytest
import torch

from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.verifier.decode.engine import Engine, Request


def _reference(model, prompt, n):
    return Engine(model, None, max_batch=1, max_seqlen=256).run([Request(list(prompt), max_new_tokens=n)])[0].output


def _bystanders(model, n: int, new_tokens: int, gen: torch.Generator):
    prompts = [torch.randint(1, model.vocab_size - 1, (int(k),), generator=gen).tolist()
               for k in torch.randint(1, 9, (n,), generator=gen)]
    refs = [_reference(model, p, new_tokens) for p in prompts]
    seen = {t for p, r in zip(prompts, refs) for t in p + r}
    poison = next(t for t in range(model.vocab_size - 1, 0, -1) if t not in seen)  # no bystander ever holds it
    return prompts, refs, poison


class PoisonDrafter(DeviceTreeDrafter):
    """Raises while drafting when a root is the poison token (a host read: fine in a CPU test)."""

    def __init__(self, model, poison: int):
        super().__init__(model)
        self.poison = poison

    def draft(self, shape, roots, sampling, any_sampled):
        if bool((roots == self.poison).any()):
            raise RuntimeError("poisoned root")
        return super().draft(shape, roots, sampling, any_sampled)


class CommitFails(DeviceTreeDrafter):
    """Raises in its commit (after the target committed): the state has moved, nothing can be restored."""

    def __init__(self, model, poison: int):
        super().__init__(model)
        self.poison = poison
        self.roots = None

    def draft(self, shape, roots, sampling, any_sampled):
        self.roots = roots.clone()
        return super().draft(shape, roots, sampling, any_sampled)

    def commit(self, path, path_len):
        if bool((self.roots == self.poison).any()):
            raise RuntimeError("poisoned commit")
        super().commit(path, path_len)


@pytest.mark.parametrize("shape", ["chain:2", "beam:2x2"])
def test_a_step_failing_on_one_sequence_ends_only_it(models, shape):
    model, draft = models["hybrid"], models["draft"]
    prompts, refs, poison = _bystanders(model, 6, 20, torch.Generator().manual_seed(7))
    engine = Engine(model, PoisonDrafter(draft, poison), [shape], max_batch=7, max_seqlen=128)
    culprit = Request([3, 4, poison], max_new_tokens=20)
    reqs = engine.run([Request(p, max_new_tokens=20) for p in prompts[:3]] + [culprit]
                      + [Request(p, max_new_tokens=20) for p in prompts[3:]])
    bystanders = reqs[:3] + reqs[4:]
    assert culprit.finish_reason == "error" and "poisoned root" in culprit.error_message and not culprit.output
    assert [r.output for r in bystanders] == refs
    assert all(r.finish_reason == "length" for r in bystanders)
    assert engine.metrics["step_failures"] >= 1 and not engine.has_work
    # the engine carries on: the next request runs normally in the freed slot
    assert engine.run([Request(prompts[0], max_new_tokens=20)])[0].output == refs[0]


def test_a_prompt_whose_prefill_fails_keeps_no_one_else_out(models, monkeypatch):
    model = models["hybrid"]
    prompts, refs, poison = _bystanders(model, 6, 12, torch.Generator().manual_seed(8))
    engine = Engine(model, None, ["none"], max_batch=7, max_seqlen=128)
    runner = engine.admission.prefiller
    real = runner.run

    def run(contexts, *args, **kwargs):
        if any(poison in c for c in contexts):
            raise RuntimeError("poisoned prompt")
        return real(contexts, *args, **kwargs)

    monkeypatch.setattr(runner, "run", run)
    culprit = Request([poison, 5, 6], max_new_tokens=12)
    reqs = engine.run([culprit] + [Request(p, max_new_tokens=12) for p in prompts])
    assert culprit.finish_reason == "error" and "poisoned prompt" in culprit.error_message
    assert [r.output for r in reqs[1:]] == refs


def test_a_failure_after_the_state_moved_ends_the_running_sequences_cleanly(models):
    model, draft = models["hybrid"], models["draft"]
    prompts, refs, poison = _bystanders(model, 2, 10, torch.Generator().manual_seed(9))
    engine = Engine(model, CommitFails(draft, poison), ["chain:2"], max_batch=3, max_seqlen=128)
    culprit = Request([1, poison], max_new_tokens=10)
    reqs = engine.run([Request(prompts[0], max_new_tokens=10), culprit, Request(prompts[1], max_new_tokens=10)])
    assert all(r.finish_reason == "error" and "poisoned commit" in r.error_message for r in reqs)
    assert all(not r.output for r in reqs)  # the failed step emitted nothing
    assert engine.run([Request(prompts[1], max_new_tokens=10)])[0].output == refs[1]  # fresh slots are exact
