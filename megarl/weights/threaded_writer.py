"""torch_dist checkpoint shards written from threads of the saving process, not from forked ones.

megatron-core 0.16's writer (`FileSystemWriterAsync.write_preloaded_data_multiproc`) forks one
process per write bucket at every save, synchronous or not. Forking a trainer that already runs
threads (gloo's, the reward pool's, the progress display's) copies into the child the locks those
threads held, without the threads that would release them, so a child can block before it writes
a byte. CI saw exactly that (tests/distributed/test_presets.py, 2026-11-27): one rank's shard
files were never created and both ranks waited until the test's timeout. Upstream megatron
replaced the forked writers with threads for the same reason (NVIDIA/Megatron-LM#3633).

`use_threaded_writers()` makes megatron's torch_dist save strategy build a writer that runs the
same per-bucket function (`FileSystemWriterAsync.write_preloaded_data`) in threads and hands its
results on in the same form, so the files, the metadata and the finalisation are megatron's own.
"""

from __future__ import annotations

import queue
import threading


def use_threaded_writers() -> None:
    """Idempotent: megatron's TorchDistSaveShardedStrategy writes with `ThreadedWriter` from now on."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if getattr(mcore_torch.FileSystemWriterAsync, "megarl_threaded", False):
        return

    class ThreadedWriter(FileSystemWriterAsync):
        megarl_threaded = True

        @staticmethod
        def write_preloaded_data_multiproc(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
            """megatron's contract: put {bucket index: [WriteResult]} (or the first exception) on
            `global_results_queue` once every bucket is written."""
            results: queue.Queue = queue.Queue()
            done: queue.Queue = queue.Queue()  # write_preloaded_data marks itself finished here
            threads = []
            for i, bucket in enumerate(write_buckets):
                done.put(i)
                threads.append(threading.Thread(
                    target=FileSystemWriterAsync.write_preloaded_data,
                    args=(transform_list, i, bucket, results, done, True),
                    kwargs={"use_msc": True} if use_msc else {}, name=f"megarl-ckpt-writer-{rank}-{i}"))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out: dict | Exception = {}
            while not results.empty():
                idx, written = results.get()
                if isinstance(written, Exception):
                    out = written
                    break
                out[idx] = written
            global_results_queue.put(out)

    mcore_torch.FileSystemWriterAsync = ThreadedWriter
