"""The copy plan (staging/copy_plan.py) that gather and scatter, torch and Triton, all run from:
what it pairs, how the page list is given to each implementation, and its validation order."""

from __future__ import annotations

import pytest
import torch

from kvstage.staging.copy_plan import Direction, PageRun, Planner
from kvstage.staging.gather_scatter import Gatherer, Scatterer


def cache(layers=2, pages=8, page_size=2, heads=4, head_dim=8):
    return ([torch.zeros(pages * page_size, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers)],
            [torch.zeros(pages * page_size, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers)])


def test_a_plan_pairs_blocks_pages_and_heads():
    k, v = cache()
    region = torch.empty(4096, dtype=torch.uint8)
    plan = Planner().plan(Direction.GATHER, k, v, [5, 6, 7, 1], 2, (1, 3), region)
    assert plan.gather and not plan.whole and plan.blocks == 4 and plan.rows == 8
    assert plan.prep.cache.tensors == (*k, *v)          # region block b <-> K layers, then V layers
    assert plan.nbytes == 4 * 8 * 2 * 8 * 2 and plan.block_bytes == plan.nbytes // 4
    assert plan.pages.tolist() == [5, 6, 7, 1]   # the base planner (Triton's): always an index tensor
    assert plan.prep.unit.nbytes == 8 and plan.prep.r == 2               # 16-byte head rows as 2 int64


def test_the_torch_path_may_replace_the_index_by_runs():
    k, v = cache()
    region = torch.empty(4096, dtype=torch.uint8)
    plan = Scatterer().plan(Direction.SCATTER, k, v, [5, 6, 7, 1, 2], 2, (0, 4), region)
    assert plan.pages == (PageRun(0, 5, 3), PageRun(3, 1, 2))
    three = Scatterer().plan(Direction.SCATTER, k, v, [5, 6, 0, 3], 2, (0, 4), region)   # over two runs
    assert isinstance(three.pages, torch.Tensor) and three.pages.tolist() == [5, 6, 0, 3]
    one = Gatherer().plan(Direction.GATHER, k, v, [2, 3, 4], 2, (1, 2), region)   # head slice, 2-token pages
    assert one.pages == (PageRun(0, 2, 3),)


def test_an_empty_list_is_an_empty_plan():
    k, v = cache()
    plan = Planner().plan(Direction.SCATTER, k, v, [], 2, (0, 4), torch.empty(0, dtype=torch.uint8))
    assert plan.n == 0 and plan.nbytes == 0 and plan.pages == ()


@pytest.mark.parametrize("direction, name", [(Direction.GATHER, "out"), (Direction.SCATTER, "src")])
def test_errors_name_the_call_and_its_region_argument(direction, name):
    k, v = cache()
    with pytest.raises(ValueError, match=f"^{direction.value}: {name} has 10 bytes, the region needs 512$"):
        Planner().plan(direction, k, v, [0], 2, (0, 4), torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"^{direction.value}: head range"):   # heads before pages, pages before region
        Planner().plan(direction, k, v, [99], 2, (0, 9), None)
    with pytest.raises(ValueError, match=f"^{direction.value}: page index 99"):
        Planner().plan(direction, k, v, [99], 2, (0, 4), None)
