"""``stree bench kernels``: the subcommand parses, refuses to run without a GPU, and its trees are valid."""

import argparse

import pytest
import torch

from stree.cli import bench as bench_cli
from stree.bench import kernels as bench_kernels
from stree.protocols.token_tree import TokenTree


def _parser():
    parser = argparse.ArgumentParser(prog="stree")
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_bench_kernels_parses_its_options():
    args = _parser().parse_args(["bench", "kernels", "--parts", "layer", "--check", "tree", "--quick"])
    assert args.func is bench_kernels.run
    assert args.parts == ["layer"] and args.check == ["tree"] and args.quick


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_bench_kernels_without_gpu_is_a_value_error(tmp_path):
    args = _parser().parse_args(["bench", "kernels", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="CUDA GPU"):
        args.func(args)


def test_bench_trees_are_valid_and_paths_cover_the_leaves():
    for name, parents in bench_kernels.BENCH_TREES:
        tree = TokenTree.from_parents([0] * len(parents), parents)
        paths = bench_kernels.root_to_leaf_paths(parents)
        assert len(paths) == len(tree.leaves()), name
        assert all(p[0] == 0 and tree.path(p[-1]) == p for p in paths), name
    assert len(bench_kernels.complete_binary_parents(63)) == 63
    assert len(bench_kernels.width_k_parents(8, 7)) == 57
