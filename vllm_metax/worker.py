"""The GPU worker on the metax platform: vLLM's own, refusing to start without the compiled ops
serving needs, with an error that names them (instead of the first missing `torch.ops._C...`
attribute deep in the model runner); where the server records its traffic, the warm-up's dummy
batches are dropped from it once the warm-up is over, and a data-parallel rank's dummy batches
while serving are not counted."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_metax.core import traffic
from vllm_metax.kernels import MissingKernelsError, missing_kernels_message
from vllm_metax.platform import compiled_ops


class MetaxWorker(Worker):
    def init_device(self):
        report = compiled_ops()
        if report.missing:
            raise MissingKernelsError(missing_kernels_message(report))
        return super().init_device()

    def compile_or_warm_up_model(self):
        try:
            return super().compile_or_warm_up_model()
        finally:
            # the dummy batches so far are no server traffic, also where the warm-up failed or
            # was interrupted (the exit's flush would write them otherwise)
            traffic.discard_warmup()

    def execute_dummy_batch(self) -> None:
        with traffic.paused():      # an idle data-parallel rank keeping in step: no traffic
            return super().execute_dummy_batch()
