"""The direct calls hvdp's backends make on Horovod's own Gloo context (a change to Horovod's source).

Listed in :data:`hvdp.horovod_build.patches.PATCHES` after the early wake; apart only to keep each
module short. ``_OPS`` is the file both change.
"""

from __future__ import annotations

from typing import Tuple

from hvdp.horovod_build.patch import Patch

_OPS = "horovod/common/operations.cc"

#: How both direct calls start: Horovod running on Gloo, the whole job's Gloo context in ``ctx`` (C++).
_OPENING = (
    "#if HAVE_GLOO\n"
    "  try {\n"
    "    if (!horovod_global.initialization_done || horovod_global.shut_down) {\n"
    "      throw std::logic_error(\"Horovod is not running (call hvdp.init() first)\");\n"
    "    }\n"
    "    if (horovod_global.control_operation != LibType::GLOO) {\n"
    "      return 2;\n"
    "    }\n"
    "    std::shared_ptr<gloo::Context> ctx =\n"
    "        horovod_global.process_set_table.Get(0).gloo_context.ctx;\n"
    "    if (!ctx) {\n"
    "      throw std::logic_error(\"the job's Gloo context is gone (Horovod shut down)\");\n"
    "    }\n"
)
#: How both end: 0 done, 1 with the exception's message in ``error``, 2 without Gloo.
_CLOSING = (
    "    return 0;\n"
    "  } catch (const std::exception& e) {\n"
    "    std::snprintf(error, (size_t)error_size, \"%s\", e.what());\n"
    "    return 1;\n"
    "  }\n"
    "#else\n"
    "  return 2;\n"
    "#endif\n"
    "}\n"
)

#: The direct allreduce's dtypes, by the code its caller passes.
_TYPES = ("float", "double", "int32_t", "int64_t")
_CASE = (
    "    case {code}:\n"
    "      if (input != data) {{  // the ring reduces from it and sends from it (GLOO_RING_FROM_INPUT)\n"
    "        opts.setInput<{type}>(static_cast<{type}*>(const_cast<void*>(input)), (size_t)count);\n"
    "      }}\n"
    "      opts.setOutput<{type}>(static_cast<{type}*>(data), (size_t)count);\n"
    "      opts.setReduceFunction(gloo::AllreduceOptions::Func(\n"
    "          (void (*)(void*, const void*, const void*, size_t)) & ::gloo::sum<{type}>));\n"
    "      break;\n"
)

#: hvdp's direct calls (:mod:`hvdp.backends.torch.direct.gradients`, :mod:`hvdp.backends.torch.direct.allreduce`),
#: run by the calling thread itself on the whole job's Gloo context, outside the background loop and its rounds:
#: ``horovod_hvdp_direct_allreduce_from``, a sum-allreduce of an input into an output (Gloo's ring reads the
#: input where it is: :data:`GLOO_RING_FROM_INPUT`; the same buffer: in place),
#: ``horovod_hvdp_direct_allreduce``, its in-place form, and ``horovod_hvdp_direct_exchange``,
#: which sends this rank's message to every other rank into places of a fixed capacity (messages of
#: different lengths arrive whole, where a collective on buffers of different sizes ends the process
#: inside Gloo). Each caller names a channel, a Gloo tag of its own (Horovod's collectives use tag 0),
#: so calls on different channels, and Horovod's own collectives, may run at the same time, while
#: calls on one channel must come in the same order on every rank, as torch.distributed's do. Each
#: waits at most ``timeout_ms`` (hvdp passes its stall timeout; 0: the context's,
#: HOROVOD_GLOO_TIMEOUT_SECONDS). Return value: 0 done, 1 failed with the reason in ``error``, 2 not a
#: Gloo job (MPI: the callers keep Horovod's path).
DIRECT_ALLREDUCE: Tuple[Patch, ...] = (
    Patch(_OPS, "bool horovod_gloo_built() {\n",
          "int horovod_hvdp_direct_allreduce_from(const void* input, void* data, long long count, int dtype,\n"
          "                                       int channel, long long timeout_ms, char* error,\n"
          "                                       int error_size) {\n"
          "  // hvdp: the sum of every rank's input into data (input may be data); dtype 0 float32, 1 float64,\n"
          "  // 2 int32, 3 int64; channel 0..65535; timeout_ms <= 0: the context's (HOROVOD_GLOO_TIMEOUT_SECONDS).\n"
          + _OPENING +
          "    gloo::AllreduceOptions opts(ctx);\n"
          "    opts.setTag(0x68760000u + (uint32_t)(channel & 0xffff));\n"
          "    if (timeout_ms > 0) {\n"
          "      opts.setTimeout(std::chrono::milliseconds(timeout_ms));\n"
          "    }\n"
          "    switch (dtype) {\n"
          + "".join(_CASE.format(code=code, type=name) for code, name in enumerate(_TYPES)) +
          "    default:\n"
          "      throw std::logic_error(\"dtype \" + std::to_string(dtype) + \" is not one of 0-3\");\n"
          "    }\n"
          "    gloo::allreduce(opts);\n"
          + _CLOSING +
          "\n"
          "int horovod_hvdp_direct_allreduce(void* data, long long count, int dtype, int channel,\n"
          "                                  long long timeout_ms, char* error, int error_size) {\n"
          "  return horovod_hvdp_direct_allreduce_from(data, data, count, dtype, channel, timeout_ms, error,\n"
          "                                            error_size);\n"
          "}\n"
          "\n"
          "int horovod_hvdp_direct_exchange(void* inbox, long long capacity, long long bytes, int channel,\n"
          "                                 long long timeout_ms, char* error, int error_size) {\n"
          "  // hvdp: this rank's message (bytes, at inbox + rank * capacity) to every other rank; rank r's\n"
          "  // lands at inbox + r * capacity. A message may be shorter than capacity, never longer.\n"
          + _OPENING +
          "    if (bytes > capacity) {\n"
          "      throw std::logic_error(\"the message is longer than a rank's place in the inbox\");\n"
          "    }\n"
          "    const int size = ctx->size;\n"
          "    const int rank = ctx->rank;\n"
          "    uint8_t* base = static_cast<uint8_t*>(inbox);\n"
          "    auto all = ctx->createUnboundBuffer(base, (size_t)capacity * (size_t)size);\n"
          "    const uint64_t slot = gloo::Slot::build(0x68, 0x68760000u + (uint32_t)(channel & 0xffff));\n"
          "    for (int r = 0; r < size; ++r) {\n"
          "      if (r != rank) {\n"
          "        all->recv(r, slot, (size_t)r * (size_t)capacity, (size_t)capacity);\n"
          "        all->send(r, slot, (size_t)rank * (size_t)capacity, (size_t)bytes);\n"
          "      }\n"
          "    }\n"
          "    const std::chrono::milliseconds timeout =\n"
          "        timeout_ms > 0 ? std::chrono::milliseconds(timeout_ms) : ctx->getTimeout();\n"
          "    for (int r = 1; r < size; ++r) {\n"
          "      all->waitRecv(timeout);\n"
          "      all->waitSend(timeout);\n"
          "    }\n"
          + _CLOSING +
          "\n"
          "bool horovod_gloo_built() {\n",
          "the direct allreduce and exchange, run by their caller on the job's Gloo context"),
    Patch(_OPS, '#include "gloo/gloo_controller.h"\n',
          '#include "gloo/gloo_controller.h"\n#include "gloo/allreduce.h"\n#include "gloo/math.h"\n'
          '#include "gloo/transport/unbound_buffer.h"\n',
          "Gloo's allreduce for the direct allreduce"),
    Patch("horovod/common/operations.h", "bool horovod_gloo_built();\n",
          "bool horovod_gloo_built();\n\n"
          "// hvdp: sum-allreduce of input into data by the calling thread on the job's Gloo context (0 done,\n"
          "// 1 failed with the reason in error, 2 not a Gloo job); the second form in place.\n"
          "int horovod_hvdp_direct_allreduce_from(const void* input, void* data, long long count, int dtype,\n"
          "                                       int channel, long long timeout_ms, char* error,\n"
          "                                       int error_size);\n"
          "int horovod_hvdp_direct_allreduce(void* data, long long count, int dtype, int channel,\n"
          "                                  long long timeout_ms, char* error, int error_size);\n"
          "\n"
          "// hvdp: every rank's message to every rank (rank r's at inbox + r * capacity; 0, 1, 2 as above).\n"
          "int horovod_hvdp_direct_exchange(void* inbox, long long capacity, long long bytes, int channel,\n"
          "                                 long long timeout_ms, char* error, int error_size);\n",
          "the direct allreduce's declaration, exported like Horovod's own C interface"),
)

#: The quiet loop. While every gradient path of the process runs direct (:mod:`hvdp.backends.torch.direct.gradients`),
#: Horovod's background loop has nothing to do, yet its rounds go on every HOROVOD_CYCLE_TIME (5 ms), each a
#: thread wake-up and a Gloo exchange on a machine whose cores the step needs. ``horovod_hvdp_quiet_loop(ms)``
#: spaces the rounds ``ms`` apart (0: the cycle time again), and while it does, every tensor submitted to
#: Horovod wakes the loop at once (the early wake's wake), so a collective is not kept waiting for the cadence;
#: the ranks' rounds still meet within ``ms``, far inside Gloo's timeout
#: (:func:`hvdp.backends.direct.quiet_ms`). A no-op with ``HVDP_EARLY_WAKE=0``.
QUIET_LOOP: Tuple[Patch, ...] = (
    Patch(_OPS, "bool hvdp_left_waiting = false;\n",
          "bool hvdp_left_waiting = false;\n"
          "\n"
          "// hvdp: the rounds' spacing while every gradient path runs direct (0: the cycle time).\n"
          "std::atomic<int> hvdp_quiet_ms(0);\n",
          "the quiet loop's spacing"),
    Patch(_OPS, "  if (hvdp_left_waiting && HvdpEarlyWakeOn() &&\n",
          "  const int hvdp_quiet = hvdp_quiet_ms.load();\n"
          "  if (hvdp_quiet > 0) {  // hvdp: the quiet loop (a submitted tensor wakes it)\n"
          "    sleep_duration = state.last_cycle_start + std::chrono::milliseconds(hvdp_quiet) - start_time;\n"
          "  }\n"
          "  if (hvdp_left_waiting && HvdpEarlyWakeOn() &&\n",
          "the quiet loop's rounds come hvdp_quiet_ms apart"),
    Patch(_OPS, "void horovod_hvdp_wake_loop() { HvdpWake(); }\n",
          "void horovod_hvdp_wake_loop() { HvdpWake(); }\n"
          "\n"
          "void horovod_hvdp_quiet_loop(int ms) {\n"
          "  hvdp_quiet_ms = (ms > 0 && HvdpEarlyWakeOn()) ? ms : 0;\n"
          "  HvdpWake();  // the new spacing from the next round on\n"
          "}\n"
          "\n"
          "void horovod_hvdp_wake_if_quiet() {\n"
          "  if (hvdp_quiet_ms.load() > 0) {\n"
          "    HvdpWake();\n"
          "  }\n"
          "}\n",
          "the quiet loop's switch, and the wake a submitted tensor gives it"),
    Patch("horovod/common/operations.h", "void horovod_hvdp_wake_loop();\n",
          "void horovod_hvdp_wake_loop();\n"
          "\n"
          "// hvdp: the background loop's rounds ms apart, any submitted tensor waking it (0: as before).\n"
          "void horovod_hvdp_quiet_loop(int ms);\n",
          "the quiet loop's declaration, exported like Horovod's own C interface"),
    Patch("horovod/common/tensor_queue.cc", '#include "logging.h"\n\nnamespace horovod {\nnamespace common {\n',
          '#include "logging.h"\n\nnamespace horovod {\nnamespace common {\n\n'
          "// hvdp: wakes the background loop when it is quiet (operations.cc).\n"
          'extern "C" void horovod_hvdp_wake_if_quiet();\n',
          "the queue wakes a quiet loop"),
    Patch("horovod/common/tensor_queue.cc",
          "  message_queue_.push(std::move(message));\n  return Status::OK();\n",
          "  message_queue_.push(std::move(message));\n  horovod_hvdp_wake_if_quiet();\n  return Status::OK();\n",
          "a submitted tensor wakes a quiet loop"),
    Patch("horovod/common/tensor_queue.cc",
          "    message_queue_.push(std::move(messages[i]));\n  }\n  return Status::OK();\n",
          "    message_queue_.push(std::move(messages[i]));\n  }\n  horovod_hvdp_wake_if_quiet();\n"
          "  return Status::OK();\n",
          "a submitted group wakes a quiet loop"),
)

_RING = "third_party/gloo/gloo/allreduce.cc"

#: Gloo's ring allreduce from an input apart from its output (``horovod_hvdp_direct_allreduce_from`` with
#: two buffers: ``hvdp.allreduce`` returning a new tensor, or into ``out=``). Gloo first copied each input
#: segment into the output and then reduced the output in place, a whole extra pass over the tensor
#: (15-20 ms of a 64 MB call here). With one input apart from the output, a received segment is now
#: reduced straight from the input (``out = in + received``: the same sum, the same reads and writes as
#: the in-place reduction), and this rank's first segments are sent straight from the input. Horovod's own
#: Gloo collectives pass no input (in place) and run as before; several inputs, as before.
GLOO_RING_FROM_INPUT: Tuple[Patch, ...] = (
    Patch(_RING, "  transport::UnboundBuffer* tmp = tmpBuffer.get();\n\n",
          "  transport::UnboundBuffer* tmp = tmpBuffer.get();\n"
          "  // hvdp: one input apart from the output: reduce from it and send from it, without copying it in.\n"
          "  transport::UnboundBuffer* hvdpIn = opts.in.size() == 1 ? opts.in[0].get() : nullptr;\n\n",
          "the ring's input apart from its output"),
    Patch(_RING,
          "        // Prepare out[0]->ptr to hold the local reduction\n"
          "        reduceInputs(prev.recvOffset, prev.recvLength);\n"
          "        // Wait for segment from neighbor.\n"
          "        tmp->waitRecv(opts.timeout);\n"
          "        // Reduce segment from neighbor into out->ptr.\n"
          "        opts.reduce(\n"
          "            static_cast<uint8_t*>(out[0]->ptr) + prev.recvOffset,\n"
          "            static_cast<const uint8_t*>(out[0]->ptr) + prev.recvOffset,\n",
          "        // Prepare out[0]->ptr to hold the local reduction (hvdp: not with an input apart)\n"
          "        if (hvdpIn == nullptr) {\n"
          "          reduceInputs(prev.recvOffset, prev.recvLength);\n"
          "        }\n"
          "        // Wait for segment from neighbor.\n"
          "        tmp->waitRecv(opts.timeout);\n"
          "        // Reduce segment from neighbor into out->ptr.\n"
          "        opts.reduce(\n"
          "            static_cast<uint8_t*>(out[0]->ptr) + prev.recvOffset,\n"
          "            static_cast<const uint8_t*>(hvdpIn != nullptr ? hvdpIn->ptr : out[0]->ptr) +\n"
          "                prev.recvOffset,\n",
          "a received segment reduced straight from the input"),
    Patch(_RING,
          "            prev.recvLength / opts.elementSize);\n"
          "      }\n"
          "      if (prev.sendLength > 0) {\n"
          "        out[0]->waitSend(opts.timeout);\n"
          "      }\n",
          "            prev.recvLength / opts.elementSize);\n"
          "      }\n"
          "      if (prev.sendLength > 0) {  // hvdp: the first segments went from the input\n"
          "        (hvdpIn != nullptr && i - 2 < (int)numSegmentsPerRank ? hvdpIn : out[0].get())\n"
          "            ->waitSend(opts.timeout);\n"
          "      }\n",
          "the first segments' sends waited for on the input"),
    Patch(_RING,
          "        if (i < numSegmentsPerRank) {\n"
          "          reduceInputs(cur.sendOffset, cur.sendLength);\n"
          "        }\n"
          "        out[0]->send(sendRank, slot, cur.sendOffset, cur.sendLength);\n",
          "        if (hvdpIn != nullptr && i < (int)numSegmentsPerRank) {  // hvdp: straight from the input\n"
          "          hvdpIn->send(sendRank, slot, cur.sendOffset, cur.sendLength);\n"
          "        } else {\n"
          "          if (i < numSegmentsPerRank) {\n"
          "            reduceInputs(cur.sendOffset, cur.sendLength);\n"
          "          }\n"
          "          out[0]->send(sendRank, slot, cur.sendOffset, cur.sendLength);\n"
          "        }\n",
          "this rank's first segments sent straight from the input"),
)

_PAIR = "third_party/gloo/gloo/transport/tcp/pair.cc"

#: Gloo's network thread without a spin while another thread holds a connection. Its epoll events are
#: level-triggered: when data has come for a connection whose lock a sending or receiving thread holds,
#: the network thread gave up the event and epoll handed it straight back, thousands of times a step
#: (about 1700 ``epoll_wait`` calls per ResNet-18 step here, on a machine whose cores the model's compute
#: fills). It now gives up its core for 20 us first, time in which the holder finishes.
GLOO_NO_SPIN: Tuple[Patch, ...] = (
    Patch(_PAIR, '#include <sstream>\n', '#include <sstream>\n#include <chrono>\n#include <thread>\n',
          "the headers of the pause"),
    Patch(_PAIR,
          "  std::unique_lock<std::mutex> lock(m_, std::try_to_lock);\n"
          "  if (!lock) {\n"
          "    return;\n"
          "  }\n",
          "  std::unique_lock<std::mutex> lock(m_, std::try_to_lock);\n"
          "  if (!lock) {\n"
          "    // hvdp: another thread holds this pair; give it the core rather than spin through epoll\n"
          "    std::this_thread::sleep_for(std::chrono::microseconds(20));\n"
          "    return;\n"
          "  }\n",
          "a pause instead of a spin while another thread holds the pair"),
)
