"""A NumPy emulator of `lax.ragged_all_to_all`'s documented semantics, for tests.

It runs every shard's call at once: argument `i` of each list is shard `i`'s argument.
"""

import numpy as np


def emulate_ragged_all_to_all(
    operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes
):
    """Returns each shard's result of one `ragged_all_to_all` with one slice per peer.

    Shard `s` sends `operands[s][input_offsets[s][d] : + send_sizes[s][d]]` to shard `d`,
    which writes it at `output_offsets[s][d]`. Checks that `recv_sizes[d][s]` equals
    `send_sizes[s][d]` and that every slice is in bounds, as the collective requires.
    """
    num = len(operands)
    results = [np.array(o, copy=True) for o in outputs]
    for s in range(num):
        for d in range(num):
            size = int(send_sizes[s][d])
            if size != int(recv_sizes[d][s]):
                raise ValueError(
                    f"send_sizes[{s}][{d}]={size} != recv_sizes[{d}][{s}]="
                    f"{int(recv_sizes[d][s])}"
                )
            if size == 0:
                continue
            i0, o0 = int(input_offsets[s][d]), int(output_offsets[s][d])
            if i0 < 0 or i0 + size > len(operands[s]):
                raise ValueError(f"input slice out of bounds: shard {s} -> {d}")
            if o0 < 0 or o0 + size > len(results[d]):
                raise ValueError(f"output slice out of bounds: shard {s} -> {d}")
            results[d][o0 : o0 + size] = operands[s][i0 : i0 + size]
    return results
