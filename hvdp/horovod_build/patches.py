"""The changes made to Horovod 0.28.1's source before it is compiled, in the order they apply.

Common to every build: C++17 instead of C++14 (torch >= 2.1 and TensorFlow's absl
headers need it), two fixes to Horovod's Gloo controller (process sets' Gloo
contexts use ``HOROVOD_GLOO_IFACE``; the stall inspector sees every rank), the launcher's
rendezvous store forgets each Gloo rendezvous once all its ranks are done (:data:`RENDEZVOUS_CLEARED`), Gloo's
reduce-scatter as one exchange and a local sum (:data:`GLOO_REDUCESCATTER`), the
early wake of Horovod's background loop (:data:`EARLY_WAKE`), and the direct calls on Horovod's
Gloo context (:data:`hvdp.horovod_build.direct_patches.DIRECT_ALLREDUCE`). Each framework's own
changes are in its module (:data:`FRAMEWORK_PATCHES`), taken in the registry's order.

Every patch's text is part of the cache key (:func:`hvdp.horovod_build.cache.patches_digest`),
so the order below is part of it too: change it only with a rebuild in mind.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from hvdp.frameworks import SPECS
from hvdp.horovod_build import tensorflow_patches, torch_patches
from hvdp.horovod_build.direct_patches import DIRECT_ALLREDUCE, GLOO_NO_SPIN, GLOO_RING_FROM_INPUT, QUIET_LOOP
from hvdp.horovod_build.patch import Patch
from hvdp.horovod_build.tensorflow_patches import KERAS3_PATCHES

#: Each framework's changes, by hvdp's name for it: a module with CMAKE_PATCHES, SOURCE_PATCHES (its
#: extension's C++), PYTHON_PATCHES, GPU_PATCHES.
FRAMEWORK_PATCHES: Dict[str, Any] = {"torch": torch_patches, "tensorflow": tensorflow_patches}

__all__ = ["DIRECT_ALLREDUCE", "EARLY_WAKE", "GLOO_NO_SPIN", "GLOO_REDUCESCATTER", "GLOO_RING_FROM_INPUT",
           "GPU_PATCHES", "KERAS3_PATCHES", "PATCHES", "PATCH_LEVEL", "Patch", "QUIET_LOOP",
           "RENDEZVOUS_CLEARED"]

#: Bump whenever the patches change in a way their text does not show, so cached wheels are rebuilt.
PATCH_LEVEL = 5

_CXX17 = Patch("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
               "current torch and TensorFlow headers need C++17")

_GLOO = (
    Patch("horovod/common/gloo/gloo_context.cc",
          "  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
          "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
          "  gloo_iface_ = global_context.gloo_iface_;\n"
          "  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
          "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
          "process-set Gloo contexts ignored HOROVOD_GLOO_IFACE and bound to the address the "
          "hostname resolves to, 127.0.1.1 on Debian hosts: multi-host Gloo jobs failed"),
    Patch("horovod/common/gloo/gloo_controller.cc", "  global_ranks_.reserve(size_);",
          "  global_ranks_.resize(size_);",
          "the Gloo controller's rank list stayed empty, so its stall inspector checked no rank "
          "and a stalled Gloo job hung forever"),
)

#: The launcher's rendezvous store (horovodrun, ``hvdp run``, elastic jobs, hvdp.ray) keeps the Gloo addresses
#: each rank publishes under a scope (``global``, ``local_<host>``, ``cross_<local rank>``) and clears a scope
#: once every rank of it has said it is done. Its bookkeeping cleared every scope's list of done ranks when one
#: scope completed, so a rank's one-rank ``cross_N`` scope, completing between the two ranks' "done" for
#: ``local_<host>``, erased the first of them: that scope was never cleared, and at the next ``hvd.init()`` after
#: a shutdown (elastic resets, test suites) a rank could read its peer's address from the previous start, its
#: listening socket closed, and Horovod's background thread died in ``connectFullMesh`` ("Connection refused" or
#: "Connect timeout"; an uncaught exception, so SIGABRT inside ``hvd.init()``). Measured before the change:
#: init, barrier, shutdown in a loop at np=2 on Gloo failed at round 5 and round 2 of 30; after, 60 of 60
#: rounds with process sets added and removed (tests/parallel/test_reinit.py keeps it).
RENDEZVOUS_CLEARED = Patch(
    "horovod/runner/http/http_server.py",
    "                        self.server.finished_list.clear()\n",
    "                        del self.server.finished_list[scope]  # hvdp: this scope's list, not every scope's\n",
    "the rendezvous store cleared every scope's list of finished ranks when one scope completed, so a scope could "
    "stay filled with a past start's addresses and the next hvd.init() after a shutdown connected to a closed port",
)

_OPS = "horovod/common/operations.cc"
_GLOO_OPS = "horovod/common/ops/gloo_operations.cc"

#: The early wake. Horovod's background loop sleeps out HOROVOD_CYCLE_TIME between two rounds,
#: so the last tensors a caller waits for (a step's last gradients, a blocking collective) wait
#: up to a whole cycle before anything moves: 5 ms of a 5.3 ms 4 KB allreduce. With this change the
#: wait is a condition variable: ``horovod_hvdp_wake_loop()`` (C, called by hvdp's backends
#: through ctypes once a step's gradients or a blocking collective are enqueued) ends it, and so
#: does a grouped allreduce (``grouped_allreduce``, hvdp's TensorFlow gradients: a group is enqueued
#: whole, so nothing more is coming for it), an allgather and a reducescatter (a sharded optimizer's
#: step waits for each in turn, on TensorFlow from inside a traced step, where no Python runs).
#: Every rank still meets in each round, so a woken round waits for the others as any round does.
#: A rank whose round ended with a tensor it submitted before that round still unfinished (another
#: rank submitted it a round later, so the ranks' rounds are one apart) starts its next round within
#: 1 ms, not at the end of the cycle: the other rank's woken round is waiting for it, and nothing
#: else would wake it. ``HVDP_EARLY_WAKE=0`` turns it all off (measured on/off by ``hvdp bench``).
EARLY_WAKE: Tuple[Patch, ...] = (
    Patch(_OPS, "#include <thread>\n", "#include <condition_variable>\n#include <mutex>\n#include <thread>\n",
          "the early wake's condition variable"),
    Patch(_OPS, "HorovodGlobalState horovod_global;\n",
          "HorovodGlobalState horovod_global;\n"
          "\n"
          "// hvdp: ends the background loop's wait between two rounds early (horovod_hvdp_wake_loop).\n"
          "std::mutex hvdp_wake_mutex;\n"
          "std::condition_variable hvdp_wake_cv;\n"
          "bool hvdp_wake_pending = false;\n"
          "\n"
          "bool HvdpEarlyWakeOn() {\n"
          "  static const bool on = [] {\n"
          "    const char* value = std::getenv(\"HVDP_EARLY_WAKE\");\n"
          "    return value == nullptr || std::string(value) != \"0\";\n"
          "  }();\n"
          "  return on;\n"
          "}\n"
          "\n"
          "void HvdpWake() {\n"
          "  if (!HvdpEarlyWakeOn()) {\n"
          "    return;\n"
          "  }\n"
          "  {\n"
          "    std::lock_guard<std::mutex> guard(hvdp_wake_mutex);\n"
          "    hvdp_wake_pending = true;\n"
          "  }\n"
          "  hvdp_wake_cv.notify_all();\n"
          "}\n"
          "\n"
          "// hvdp: whether the last round left a tensor submitted before it unfinished.\n"
          "bool hvdp_left_waiting = false;\n"
          "\n"
          "// hvdp: tensors ever submitted, and tensors still unfinished, over every process set.\n"
          "std::pair<int64_t, int64_t> HvdpQueueCounts(HorovodGlobalState& state) {\n"
          "  std::pair<int64_t, int64_t> counts(0, 0);\n"
          "  for (auto id : state.process_set_table.Ids()) {\n"
          "    auto one = state.process_set_table.Get(id).tensor_queue.HvdpCounts();\n"
          "    counts.first += one.first;\n"
          "    counts.second += one.second;\n"
          "  }\n"
          "  return counts;\n"
          "}\n",
          "the early wake's state, and HVDP_EARLY_WAKE=0 to turn it off"),
    Patch(_OPS,
          "  if (sleep_duration > std::chrono::steady_clock::duration::zero()) {\n"
          "    std::this_thread::sleep_for(sleep_duration);\n"
          "  }\n"
          "  state.last_cycle_start = std::chrono::steady_clock::now();\n",
          "  if (hvdp_left_waiting && HvdpEarlyWakeOn() &&\n"
          "      sleep_duration > std::chrono::milliseconds(1)) {\n"
          "    sleep_duration = std::chrono::milliseconds(1);  // hvdp: another rank's round waits\n"
          "  }\n"
          "  if (sleep_duration > std::chrono::steady_clock::duration::zero()) {\n"
          "    std::unique_lock<std::mutex> lock(hvdp_wake_mutex);\n"
          "    hvdp_wake_cv.wait_for(lock, sleep_duration, [] { return hvdp_wake_pending; });\n"
          "  }\n"
          "  {\n"
          "    std::lock_guard<std::mutex> guard(hvdp_wake_mutex);\n"
          "    hvdp_wake_pending = false;\n"
          "  }\n"
          "  state.last_cycle_start = std::chrono::steady_clock::now();\n"
          "  const auto hvdp_before = HvdpQueueCounts(state);\n",
          "the cycle's sleep becomes a wait a wake can end, or 1 ms when the last round left "
          "this rank's tensors waiting"),
    Patch(_OPS, "  return !should_shutdown;\n}\n",
          "  // hvdp: unfinished tensors beyond those submitted during this round were submitted before it.\n"
          "  const auto hvdp_after = HvdpQueueCounts(state);\n"
          "  hvdp_left_waiting = hvdp_after.second - (hvdp_after.first - hvdp_before.first) > 0;\n"
          "  return !should_shutdown;\n}\n",
          "each round notes whether it left this rank's earlier tensors waiting"),
    Patch("horovod/common/tensor_queue.h", "  void RemoveJoinTensor();\n",
          "  void RemoveJoinTensor();\n"
          "\n"
          "  // hvdp: (tensors ever submitted here, tensors submitted and not yet finished).\n"
          "  std::pair<int64_t, int64_t> HvdpCounts() const {\n"
          "    std::lock_guard<std::mutex> guard(mutex_);\n"
          "    return std::make_pair(hvdp_submitted_, (int64_t)tensor_table_.size());\n"
          "  }\n"
          "\n"
          "protected:\n"
          "  int64_t hvdp_submitted_ = 0;\n",
          "the queue counts what it was given, for the early wake"),
    Patch("horovod/common/tensor_queue.cc", "  tensor_table_.emplace(e.tensor_name, std::move(e));\n",
          "  tensor_table_.emplace(e.tensor_name, std::move(e));\n  ++hvdp_submitted_;\n",
          "a submitted tensor is counted"),
    Patch("horovod/common/tensor_queue.cc",
          "    tensor_table_.emplace(entries[i].tensor_name, std::move(entries[i]));\n",
          "    tensor_table_.emplace(entries[i].tensor_name, std::move(entries[i]));\n    ++hvdp_submitted_;\n",
          "a submitted group's tensors are counted"),
    Patch(_OPS, "  status = process_set.tensor_queue.AddToTensorQueueMulti(entries, messages);\n",
          "  status = process_set.tensor_queue.AddToTensorQueueMulti(entries, messages);\n"
          "  if (status.ok() && tensors.size() > 1) {\n"
          "    HvdpWake();  // hvdp: a group arrives whole; nothing more is coming for it\n"
          "  }\n",
          "a grouped allreduce wakes the loop"),
    *(Patch(_OPS,
            "      process_set.tensor_queue.AddToTensorQueueMulti(entries, messages);\n\n  return status;\n}\n\n"
            "// Contexts and controller must be initialized and the background thread\n"
            f"// must be running before this function is called.\nStatus EnqueueTensor{following}(",
            "      process_set.tensor_queue.AddToTensorQueueMulti(entries, messages);\n"
            "  if (status.ok()) {\n"
            f"    HvdpWake();  // hvdp: {kind} is what its caller waits for next\n"
            "  }\n\n  return status;\n}\n\n"
            "// Contexts and controller must be initialized and the background thread\n"
            f"// must be running before this function is called.\nStatus EnqueueTensor{following}(",
            f"{kind} wakes the loop (a sharded step waits for each, and nothing else is coming for it)")
      for kind, following in (("an allgather", "Broadcast"), ("a reducescatter", "Alltoall"))),
    Patch(_OPS, "bool horovod_gloo_built() {\n",
          "void horovod_hvdp_wake_loop() { HvdpWake(); }\n\nbool horovod_gloo_built() {\n",
          "the C entry point hvdp's backends call (its name matches *horovod*, the pattern Horovod's "
          "linker script exports)"),
    Patch("horovod/common/operations.h", "bool horovod_gloo_built();\n",
          "bool horovod_gloo_built();\n\n"
          "// hvdp: ends the background loop's wait for its next round now (HVDP_EARLY_WAKE=0: no-op).\n"
          "void horovod_hvdp_wake_loop();\n",
          "the early wake's declaration, exported like Horovod's own C interface"),
)


#: Gloo's allreduce of one tensor copied the input into the output before reducing the output, even
#: when they are one buffer (Horovod's in-place ``allreduce_``, ``hvdp.allreduce(out=value)``, a
#: gradient). Measured afterwards: glibc 2.36's memcpy returns at once when source and destination
#: are the same (64 MB: 0.00 ms; the breakdown's in-place "untimed copy" was 4-5 us), so on this
#: machine it changes nothing; it spares C libraries whose memcpy copies anyway.
_GLOO_IN_PLACE = Patch(
    _GLOO_OPS,
    "    buffer_data = (void*)first_entry.output->data();\n"
    "    std::memcpy(buffer_data, first_entry.tensor->data(),\n"
    "                (size_t)first_entry.tensor->size());\n",
    "    buffer_data = (void*)first_entry.output->data();\n"
    "    if (buffer_data != first_entry.tensor->data()) {  // hvdp: in place needs no copy\n"
    "      std::memcpy(buffer_data, first_entry.tensor->data(),\n"
    "                  (size_t)first_entry.tensor->size());\n"
    "    }\n",
    "Gloo's in-place allreduce of one tensor copied the tensor onto itself",
)


#: Gloo's reduce-scatter (a sharded optimizer's gradients, ``hvdp.reducescatter``). Horovod built
#: Gloo's halving-doubling algorithm anew for each call, which allocates and registers its buffers
#: each time, and copied a lone tensor into a buffer it allocated each call (every page faulted in
#: again). With this change the ranks exchange their blocks in one Gloo alltoallv, straight from the
#: tensor (or the fusion buffer), into a buffer the background thread keeps from call to call, and
#: each rank sums the blocks it received, in rank order, into its output. Measured on a 45 MB float32
#: tensor at np=2 (Horovod's timeline): 77 ms per call before (18.7 ms copying in, 49.2 ms in Gloo, 3.7
#: ms copying out), against 41-50 ms for Horovod's fused allreduce of the same bytes.
GLOO_REDUCESCATTER: Tuple[Patch, ...] = (
    Patch("horovod/common/ops/gloo_operations.h",
          "  virtual void Reducescatter(void* buffer_data,\n"
          "                             std::vector<int>& recvcounts) = 0;\n",
          "  virtual void Reducescatter(void* buffer_data,\n"
          "                             std::vector<int>& recvcounts) = 0;\n"
          "\n"
          "  // hvdp: this rank's block of the sum of the ranks' inputs into output (input may be output).\n"
          "  virtual void HvdpReducescatter(const void* input, void* output,\n"
          "                                 std::vector<int>& recvcounts) = 0;\n",
          "the reduce-scatter that reads its input where it is (declaration)"),
    Patch("horovod/common/ops/gloo_operations.h",
          "  void Reducescatter(void* buffer_data, std::vector<int>& recvcounts) override;\n",
          "  void Reducescatter(void* buffer_data, std::vector<int>& recvcounts) override;\n"
          "\n"
          "  void HvdpReducescatter(const void* input, void* output,\n"
          "                         std::vector<int>& recvcounts) override;\n",
          "the reduce-scatter that reads its input where it is (each type's)"),
    Patch(_GLOO_OPS,
          "template <typename T>\n"
          "void GlooAlgorithms<T>::Reducescatter(void* buffer_data,\n"
          "                                      std::vector<int>& recvcounts) {\n"
          "  std::vector<T*> ptrs{reinterpret_cast<T*>(buffer_data)};\n"
          "  int num_elements = std::accumulate(recvcounts.begin(), recvcounts.end(), 0);\n"
          "  gloo::ReduceScatterHalvingDoubling<T> rs_hd(gloo_context_->ctx, ptrs,\n"
          "                                              num_elements, recvcounts);\n"
          "  rs_hd.run();\n"
          "}\n",
          "// hvdp: bytes the background thread keeps from call to call (which: 0 the blocks received,\n"
          "// 1 a scaled copy of the input).\n"
          "uint8_t* HvdpScratch(int which, size_t bytes) {\n"
          "  static thread_local std::vector<uint8_t> kept[2];\n"
          "  auto& buffer = kept[which];\n"
          "  if (buffer.size() < bytes || buffer.empty()) {\n"
          "    buffer.resize(std::max<size_t>(bytes, 1));\n"
          "  }\n"
          "  return buffer.data();\n"
          "}\n"
          "\n"
          "template <>\n"
          "void GlooAlgorithms<bool>::HvdpReducescatter(const void* input, void* output,\n"
          "                                             std::vector<int>& recvcounts) {\n"
          "  throw std::logic_error(\"GlooReducescatter does not support bool data.\");\n"
          "}\n"
          "\n"
          "template <typename T>\n"
          "void GlooAlgorithms<T>::HvdpReducescatter(const void* input, void* output,\n"
          "                                          std::vector<int>& recvcounts) {\n"
          "  // hvdp: block r of the input goes to rank r in one exchange (Gloo's alltoallv), then this\n"
          "  // rank sums the blocks it received, in rank order, into output.\n"
          "  const auto& ctx = gloo_context_->ctx;\n"
          "  const int size = ctx->size;\n"
          "  const size_t mine = (size_t)recvcounts[ctx->rank];\n"
          "  std::vector<int64_t> sent(recvcounts.begin(), recvcounts.end());\n"
          "  std::vector<int64_t> received((size_t)size, (int64_t)mine);\n"
          "  T* blocks = reinterpret_cast<T*>(HvdpScratch(0, (size_t)size * mine * sizeof(T)));\n"
          "  gloo::AlltoallvOptions opts(ctx);\n"
          "  opts.setInput<T>(static_cast<T*>(const_cast<void*>(input)), sent);\n"
          "  opts.setOutput<T>(blocks, received);\n"
          "  gloo::alltoallv(opts);\n"
          "  T* out = static_cast<T*>(output);\n"
          "  if (size == 1) {\n"
          "    std::memcpy(out, blocks, mine * sizeof(T));\n"
          "    return;\n"
          "  }\n"
          "  ::gloo::sum<T>(out, blocks, blocks + mine, mine);\n"
          "  for (int r = 2; r < size; ++r) {\n"
          "    ::gloo::sum<T>(out, out, blocks + (size_t)r * mine, mine);\n"
          "  }\n"
          "}\n"
          "\n"
          "template <typename T>\n"
          "void GlooAlgorithms<T>::Reducescatter(void* buffer_data,\n"
          "                                      std::vector<int>& recvcounts) {\n"
          "  HvdpReducescatter(buffer_data, buffer_data, recvcounts);  // hvdp\n"
          "}\n",
          "Gloo's reduce-scatter: one alltoallv and a local sum, in buffers kept from call to call, "
          "instead of a halving-doubling algorithm built anew each call"),
    Patch(_GLOO_OPS,
          "  } else {\n"
          "    // Allocating a temp buffer because the Reducescatter will be performed\n"
          "    // in place and the output tensor will be smaller than the input.\n"
          "    buffer_data = new uint8_t[first_entry.tensor->size()];\n"
          "    std::memcpy(buffer_data, first_entry.tensor->data(),\n"
          "                first_entry.tensor->size());\n"
          "  }\n",
          "  } else if (prescale_factor != 1.0) {\n"
          "    // hvdp: the copy to scale goes to a buffer kept from call to call\n"
          "    buffer_data = HvdpScratch(1, first_entry.tensor->size());\n"
          "    std::memcpy(buffer_data, first_entry.tensor->data(),\n"
          "                first_entry.tensor->size());\n"
          "  } else {\n"
          "    buffer_data = const_cast<void*>(first_entry.tensor->data());  // hvdp: sent from where it is\n"
          "  }\n",
          "a lone tensor's reduce-scatter copied it into a buffer allocated each call"),
    Patch(_GLOO_OPS,
          "  gloo_algos->Reducescatter(buffer_data, recvcounts);\n",
          "  // hvdp: a lone tensor's block is summed straight into its output (fused ones into the buffer's start)\n"
          "  gloo_algos->HvdpReducescatter(\n"
          "      buffer_data, entries.size() > 1 ? buffer_data : const_cast<void*>(first_entry.output->data()),\n"
          "      recvcounts);\n",
          "a lone tensor's reduce-scatter writes its output directly"),
    Patch(_GLOO_OPS,
          "    void* output_pointer = const_cast<void*>(first_entry.output->data());\n"
          "    std::memcpy(output_pointer, buffer_data, first_entry.output->size());\n"
          "    delete[] reinterpret_cast<uint8_t*>(buffer_data);\n",
          "    // hvdp: already in the output\n",
          "a lone tensor's reduce-scatter copied its output out of the temporary buffer"),
)


#: Every build's patches: the CMake files (top level, then each framework's extension), the
#: common C++ sources, each framework's own C++, then each framework's Python layer.
PATCHES: Tuple[Patch, ...] = (
    _CXX17,
    *(patch for name in SPECS for patch in FRAMEWORK_PATCHES[name].CMAKE_PATCHES),
    *_GLOO,
    RENDEZVOUS_CLEARED,
    _GLOO_IN_PLACE,
    *GLOO_REDUCESCATTER,
    *EARLY_WAKE,
    *DIRECT_ALLREDUCE,
    *GLOO_RING_FROM_INPUT,
    *GLOO_NO_SPIN,
    *QUIET_LOOP,
    *(patch for name in SPECS for patch in FRAMEWORK_PATCHES[name].SOURCE_PATCHES),
    *(patch for name in SPECS for patch in FRAMEWORK_PATCHES[name].PYTHON_PATCHES),
)

#: Changes only a GPU build needs (``hvdp build --gpu``); applied after PATCHES, and part of the
#: cache key of GPU builds only (:func:`hvdp.horovod_build.build.build_inputs`), so CPU builds keep their key.
#: Measured with CUDA 13.0 and NCCL 2.29 from PyPI's wheels: Horovod's CUDA kernels compile as they
#: are (C++11 suits nvcc 13.0, and the architectures are those nvcc lists, so none that CUDA 13 dropped).
GPU_PATCHES: Tuple[Patch, ...] = tuple(patch for name in SPECS for patch in FRAMEWORK_PATCHES[name].GPU_PATCHES)
