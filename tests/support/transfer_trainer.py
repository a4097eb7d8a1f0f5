"""A trainer process for tests/weights/test_transfer.py: publishes a checkpoint's params with
`hotswap.weights.transfer.publish`, prints the reference as one JSON line, and stays alive (keeping
the offer) until its stdin closes.

    python tests/support/transfer_trainer.py CHECKPOINT_DIR MODE

MODE: ok | tp2 (sharded as a tensor_parallel_size=2 engine shards them; needs 2 devices) |
shape (one tensor transposed) | nan (one NaN) | stall (header and manifest are offered, the
weights never are: killing this process then is a kill mid-pull) | procs (tp2, one offer per
engine process of a 2-process engine: `publish(for_processes=2)`) | procs-shape1 (the same,
but process 1's offer has one tensor two rows too long) | procs-stall1 (process 1's weights
are never offered) | procs-nan (one NaN, in process 0's shard).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.checkpoint import hf
from hotswap.model import sharding
from hotswap.weights import transfer


def main(path: str, mode: str) -> None:
    cfg, params = hf.load_hf_dir(path)
    params = jax.tree.map(jnp.asarray, params)
    if mode == "tp2" or mode.startswith("procs"):
        shardings, _ = sharding.engine_shardings(cfg, 2)
        params = jax.tree.map(jax.device_put, params, shardings)
    if mode == "shape":
        wq = params["layers"][0]["wq"]  # [D, Hq, hd]: sent flat, HF-style [out, in] and a column short
        params["layers"][0]["wq"] = wq.reshape(wq.shape[0], -1).T[:, :-1]
    if mode in ("nan", "procs-nan"):
        params["layers"][1]["w_up"] = params["layers"][1]["w_up"].at[0, 0].set(np.nan)
    if mode == "stall":
        _, header, blob = transfer.offer_arrays(params)
        srv, uuid = transfer.server(), next(transfer._uuids)
        srv.await_pull(uuid, [header])
        srv.await_pull(uuid + 1, [blob])
        ref = transfer.TransferRef(srv.address(), uuid)
    elif mode in ("procs-shape1", "procs-stall1"):  # process 0's offer is right, process 1's is not
        bad = params
        if mode == "procs-shape1":
            wq = params["layers"][0]["wq"]
            bad = {**params, "layers": [dict(params["layers"][0]), *params["layers"][1:]]}
            bad["layers"][0]["wq"] = jax.device_put(jnp.concatenate([wq, wq[:2]]), wq.sharding)
        srv, uuid = transfer.server(), transfer.take_uuids(2)
        for p, tree in enumerate((params, bad)):
            leaves, header, blob = transfer.process_offer(tree, p, 2)
            srv.await_pull(uuid + 4 * p, [header])
            srv.await_pull(uuid + 4 * p + 1, [blob])
            if p == 0 or mode == "procs-shape1":
                srv.await_pull(uuid + 4 * p + 2, leaves)
        ref = transfer.TransferRef(srv.address(), uuid, processes=2)
    else:
        ref = transfer.publish(params, for_processes=2 if mode.startswith("procs") else 1)
    print(json.dumps(ref.to_json()), flush=True)
    sys.stdin.read()  # the offer lives as long as this process


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
