"""The ``treeflash`` and ``treeflash-marginal`` drafter plugins: a TreeFlash network run in the engine's step.

TreeFlash reads the target's hidden states, which only the engine that runs the target has, so
it drafts as a device drafter inside the engine's one-graph step (``stree.generate``, ``Engine``).
It has no host session: a host or remote (gRPC) drafter never sees the target's hidden states, and
drafting from anything else would be a different, untrained drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from stree.protocols.device_drafter import DeviceOffer
from stree.protocols.sampling import SamplingParams
from stree.protocols.tree_shape import TreeShape
from stree.drafter_service.drafters.treeflash.device_draft import TreeFlashDeviceDrafter
from stree.verifier.model.treeflash import TreeFlashNet, load_treeflash

DEFAULT_TREE = "static:3,2,1,1"


def default_tree(net: TreeFlashNet) -> str:
    """``DEFAULT_TREE`` cut to the network's depth (a TreeFlash net drafts at most ``depth`` levels)."""
    widths = DEFAULT_TREE.split(":")[1].split(",")[: net.config.depth]
    return "static:" + ",".join(widths)


class TreeFlashDrafter:
    """A TreeFlash network and the tree layout it drafts (``conditional=False``: the marginal ablation)."""

    def __init__(self, net: TreeFlashNet, tree: Union[str, TreeShape, None] = None, conditional: bool = True):
        self.net = net
        tree = tree or default_tree(net)
        self.shape = tree if isinstance(tree, TreeShape) else TreeShape.parse(tree)
        self.name = "treeflash" if conditional else "treeflash-marginal"
        self._device = TreeFlashDeviceDrafter(net, conditional)
        if not self._device.supports(self.shape):
            raise ValueError(f"tree: treeflash drafts chain/static trees of depth <= {net.config.depth} "
                             f"(the network's depth), not {self.shape}")

    @property
    def vocab_size(self) -> int:
        return self.net.vocab_size

    def device_drafter(self) -> DeviceOffer:
        """Its device drafter over its one tree shape."""
        return DeviceOffer(self._device, [self.shape])

    def open(self, prompt_ids: Sequence[int], params: SamplingParams):
        raise ValueError("treeflash reads the target's hidden states, so it drafts only inside the engine "
                         "(stree.generate / Engine); it cannot run as a host or remote drafter")


def _network(treeflash, draft_model, device) -> TreeFlashNet:
    source = treeflash if treeflash is not None else draft_model
    if isinstance(source, TreeFlashNet):
        return source
    if isinstance(source, (str, Path)):
        return load_treeflash(source, device=device or "cpu")
    raise ValueError("treeflash needs its network: treeflash=<TreeFlashNet or checkpoint directory> "
                     "(or draft_model=<TreeFlashNet>)")


def make_treeflash_drafter(treeflash=None, draft_model=None, tree: Optional[str] = None,
                           conditional: bool = True, device=None, **_) -> TreeFlashDrafter:
    """TreeFlash with its conditional head (children re-scored per parent)."""
    net = _network(treeflash, draft_model, device)
    return TreeFlashDrafter(net, tree or default_tree(net), conditional)


def make_treeflash_marginal_drafter(treeflash=None, draft_model=None, tree: Optional[str] = None,
                                    device=None, **_) -> TreeFlashDrafter:
    """The ablation: the same network with the conditional head off (every branch at a depth shares its marginal)."""
    net = _network(treeflash, draft_model, device)
    return TreeFlashDrafter(net, tree or default_tree(net), conditional=False)
