"""engine.step_tensors: the decode tables kept between steps equal the plan's padded tables, step after step."""
from __future__ import annotations

import random

import torch

from kaon_runtime.engine.step_plan import StepPlan
from kaon_runtime.engine.step_tensors import DecodeTables, long_tensor


def padded(tables: list[list[int]]) -> torch.Tensor:
    return torch.tensor(StepPlan(decode_tables=tables).padded_decode_tables(), dtype=torch.long)


def test_long_tensor_is_torch_tensor_of_the_values():
    cpu = torch.device("cpu")
    for values in ([], [3, -1, 2**40], [[1, 2], [3, 4]]):
        got = long_tensor(values, cpu)
        assert got.dtype == torch.long and torch.equal(got, torch.tensor(values, dtype=torch.long))


def test_kept_rows_equal_the_padded_tables_as_sequences_grow_change_and_go():
    """Sequences grow by a block now and then, some are rewritten (a preemption's new blocks, a truncation),
    some leave and come back, new ones join past the store's size: every step's gather is the padded tables."""
    rng = random.Random(0)
    tables = DecodeTables()
    live: dict[int, list[int]] = {i: [rng.randrange(1000) for _ in range(rng.randint(1, 4))] for i in range(6)}
    next_id = 6
    for step in range(200):
        for seq_id, table in live.items():
            roll = rng.random()
            if roll < 0.2:
                table.append(rng.randrange(1000))  # a new block
            elif roll < 0.25:
                live[seq_id] = [rng.randrange(1000) for _ in range(rng.randint(1, 6))]  # re-admitted elsewhere
            elif roll < 0.28 and len(table) > 1:
                del table[-1]  # truncated
        if rng.random() < 0.3:  # a new sequence, sometimes many (the store grows)
            for _ in range(rng.choice([1, 1, 9])):
                live[next_id] = [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
                next_id += 1
        if rng.random() < 0.3 and len(live) > 1:  # one finishes
            del live[rng.choice(list(live))]
        decoding = [i for i in live if rng.random() < 0.85]  # the others are in a prefill chunk this step
        if not decoding:
            continue
        rng.shuffle(decoding)
        step_tables = [list(live[i]) for i in decoding]  # the plan's copies
        got = tables.gather(decoding, step_tables)
        assert torch.equal(got, padded(step_tables)), f"step {step}"
        assert len(tables) == len(decoding)


def test_a_gathered_tensor_is_not_changed_by_the_next_step():
    tables = DecodeTables()
    first = tables.gather([1, 2], [[5, 6], [7]])
    tables.gather([1, 2], [[9, 9, 9], [8, 8]])
    assert first.tolist() == [[5, 6], [7, 0]]


def test_a_steps_plan_lists_decode_rows_first_with_their_tables_and_ids():
    """plan_step's decode rows (one token, no drafts) as the general chunk rows would list them, beside a
    prefill chunk: token, position, cache slot, table cut to the context, length, sample row, sequence id."""
    from kaon_runtime.engine.scheduler import ScheduledBatch
    from kaon_runtime.engine.sequence import Sequence
    from kaon_runtime.engine.step_plan import plan_step
    from kaon_runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=10)
    bs = 4
    prefill = Sequence(7, list(range(100, 106)), 6, params, block_table=[40, 41])  # 6-token prompt, 2 blocks
    short = Sequence(3, [1, 2, 3, 4, 5], 3, params, block_table=[9, 8, 99], num_computed_tokens=4)  # pos 4: block 8
    edge = Sequence(5, [1, 2, 3, 4], 2, params, block_table=[6, 99], num_computed_tokens=3)  # pos 3: block 6's last
    plan, sampling = plan_step(ScheduledBatch([prefill, short, edge], [6, 1, 1]), bs)
    assert plan.input_ids == [5, 4] + list(range(100, 106))
    assert plan.positions == [4, 3] + list(range(6))
    assert plan.slots == [8 * bs + 0, 6 * bs + 3] + [40 * bs + p for p in range(4)] + [41 * bs + p for p in range(2)]
    assert plan.decode_tables == [[9, 8], [6]] and plan.decode_lens == [5, 4] and plan.decode_seq_ids == [3, 5]
    assert plan.prefills == [(2, 6, 6, [40, 41])]
    assert plan.sample_rows == [0, 1, 7] and sampling == [short, edge, prefill]
