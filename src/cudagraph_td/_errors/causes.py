"""What a CUDA error raised during a capture usually means, by a phrase of its message.

The hints that `_errors.inputs.capture_failure` adds to a failed capture's error: the words that
turn a driver's error code into the line of the user's function to change.
"""

# Phrases of an error's message, and what they mean; the first entry whose phrase the
# message holds gives the hint.
CAPTURE_CAUSES: dict[tuple[str, ...], str] = {
    ("the capture failed on rank",): (
        "another rank of the DDP step's process group could not capture its graph (its own "
        "error says why), so every rank dropped its graph: no rank may replay collectives "
        "that another does not."
    ),
    (
        "operation not permitted when stream is capturing",
        "cudaErrorStreamCaptureUnsupported",
        "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
        # A synchronisation or query of an event recorded on the capturing stream.
        "operation not permitted on an event last recorded in a capturing stream",
        "cudaErrorCapturedEvent",
    ): (
        "the function synchronises the host with the GPU there (a value read on the host: "
        "`.item()`, `bool()` or an `if` on a tensor, `print()`; `nonzero()`; a copy to CPU "
        "memory), which a graph cannot capture. Move it out of the function, or compute on "
        'the device (`torch.where`); the docs\' Sharp edges page, "Host synchronisation", '
        "lists every case."
    ),
    ("cusolver error", "CUSOLVER_STATUS"): (
        "the function calls a `torch.linalg` decomposition (`eigh`, `eigvalsh`, ...) "
        "whose CUDA solver (cuSOLVER) synchronises the host or cannot run inside a capture: "
        "compute it outside the function and pass the result in, or keep that part eager."
    ),
    ("Expected all tensors to be on the same device",): (
        "the function makes a tensor without `device=` (`torch.ones(3)`, `torch.tensor([...])`), "
        "which is on the CPU, and uses it with the graph's tensors: make it on their device "
        "(`torch.ones(3, device=x.device)`), or once, outside the function."
    ),
    ("cudaErrorStreamCaptureImplicit", "legacy stream", "capturing blocking stream"): (
        "the function uses the default (legacy) stream or another stream that is not "
        "ordered after the capture stream; often an operation between devices. Keep the "
        "function's work on the current stream. In grad mode, it is also what a capture "
        "meets when a result of an earlier call (another shape's graph, an eager forward) "
        "still holds its autograd graph: autograd then accumulates the parameters' "
        "gradients on the caller's stream. Capture every shape first (`precapture`), or "
        "run that result's backward before the new shape's first calls."
    ),
    ("capturable is False", "capturable=False"): (
        "an optimizer steps inside the capture without `capturable=True`: build it with "
        "`capturable=True` (Adam, AdamW and others), so that its step counts stay on the "
        "GPU and its update is recorded."
    ),
    ("for a CUDA generator not in capture mode",): (
        "the function draws random numbers from a `torch.Generator` of its own, which a "
        "graph cannot advance at its replays: draw them from the default generator "
        "(`torch.manual_seed` seeds it; each graph gets its own offset into it), or draw "
        "them outside the function and pass them in."
    ),
    ("backward through the graph a second time",): (
        "the function ran a backward and returned a tensor of that graph that still "
        "requires grad (a loss without `.detach()`?): return `loss.detach()` from a function "
        "that runs its own `backward()`."
    ),
    ("cudaErrorStreamCaptureInvalidated", "capture was invalidated"): (
        "an earlier operation of the function broke the capture, often a host "
        "synchronisation (`.item()`, `print()` of a CUDA tensor, an `if` on a tensor: "
        "compute on the device instead, `torch.where` for a branch) or work on another "
        "stream."
    ),
}
