// TensorFlow kernel of the read bridge (yogastore/train/tf_ops.py builds and loads it).
//
// YogastoreGatherBytes: strings [n] cut from one uint8 buffer, string i being
// values[starts[i]:starts[i] + lengths[i]]. A batch of strings crosses from
// Python as arrays (the buffer may be a read-only view of the mapped chunks,
// handed over without a copy); this kernel makes the strings in a tf.data
// thread, with one bounds-checked copy each and no Python object per string.
//
// YogastoreJoinBytes: the other way, for a cache build. Strings [n] become
// their bytes one after another plus their lengths, one copy each, in a
// tf.data thread: the first pass then takes a batch of strings as two arrays.

#include <setjmp.h>
#include <signal.h>
#include <sys/stat.h>

#include <cstring>
#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
using ::tensorflow::tstring;
namespace shape_inference = ::tensorflow::shape_inference;

REGISTER_OP("YogastoreGatherBytes")
    .Input("values: uint8")
    .Input("starts: int64")
    .Input("lengths: int64")
    .Input("file: string")
    .Input("file_guard: int64")
    .Output("strings: string")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle values;
      shape_inference::ShapeHandle starts;
      shape_inference::ShapeHandle lengths;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &values));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &starts));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &lengths));
      TF_RETURN_IF_ERROR(c->Merge(starts, lengths, &starts));
      shape_inference::ShapeHandle file;
      shape_inference::ShapeHandle guard;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &file));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &guard));
      c->set_output(0, starts);
      return absl::OkStatus();
    })
    .Doc(R"doc(Strings values[starts[i]:starts[i] + lengths[i]], one per start.

When values maps a file (a read-only view of a local store's chunks), file
names it and file_guard holds its device, inode and the size it must keep. A
file that shrank since would kill the process on a read (SIGBUS), so the
kernel fails instead. An empty file name skips the check.)doc");

constexpr int64_t kCheckBytes = 256 << 10;
// The strings of a batch lie in random order across the mapped chunks: the first two cache
// lines of the string kPrefetchAhead places on are requested while the current one is copied,
// so several misses are outstanding at once (prefetching never faults, also past a file's end).
constexpr int64_t kPrefetchAhead = 8;

// The mapped file, if any, must not have shrunk below what was read from it.
absl::Status CheckFile(const Tensor& file, const Tensor& guard) {
  if (!TensorShapeUtils::IsScalar(file.shape()) || guard.NumElements() != 3) {
    return absl::InvalidArgumentError("file must be a scalar and file_guard hold 3 values");
  }
  const std::string path(file.scalar<tstring>()());
  if (path.empty()) return absl::OkStatus();
  const int64_t* g = guard.flat<int64_t>().data();
  struct stat st;
  // A file no longer at its path, or another file there: the mapped one was
  // deleted or replaced, and its pages stay readable.
  if (stat(path.c_str(), &st) != 0 || static_cast<int64_t>(st.st_dev) != g[0] ||
      static_cast<int64_t>(st.st_ino) != g[1] || st.st_nlink == 0) {
    return absl::OkStatus();
  }
  if (static_cast<int64_t>(st.st_size) < g[2]) {
    return absl::DataLossError(absl::StrCat(
        path, ": the file shrank from ", g[2], " to ", static_cast<int64_t>(st.st_size),
        " bytes while this process had it open (truncated by something other than LMDB); "
        "the cache is corrupted, delete and rebuild this version"));
  }
  return absl::OkStatus();
}

// SIGBUS guard, as in yogastore/_gather.c: a file cut short between two checks makes the
// copy of its lost pages fault; while a copy runs, a SIGBUS in its thread ends the copy and
// the kernel fails instead. Any other SIGBUS goes to the handler installed before.
thread_local sigjmp_buf* bus_target = nullptr;
struct sigaction previous_bus;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  sigjmp_buf* target = bus_target;
  // Only a fault of this thread's own access (si_code > 0) ends the copy; a SIGBUS sent by
  // kill() (si_code <= 0) goes on as without the guard.
  if (target != nullptr && info != nullptr && info->si_code > 0) {
    bus_target = nullptr;
    siglongjmp(*target, 1);
  }
  if (previous_bus.sa_flags & SA_SIGINFO) {
    previous_bus.sa_sigaction(sig, info, context);
    return;
  }
  if (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN) {
    previous_bus.sa_handler(sig);
    return;
  }
  sigaction(SIGBUS, &previous_bus, nullptr);  // default: the fault recurs and ends the process
  if (info == nullptr || info->si_code <= 0) raise(sig);
}

const bool bus_guard_installed = [] {
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  return sigaction(SIGBUS, &action, &previous_bus) == 0;
}();

// Strings [i, stop) copied from base; returns false if a SIGBUS cut the copy short (the
// strings then hold what was copied, and the kernel fails).
bool CopyStrings(tstring* strings, const char* base, const int64_t* pos, const int64_t* len,
                 int64_t i, int64_t stop, int64_t n) {
  sigjmp_buf target;
  if (sigsetjmp(target, 0) != 0) return false;  // the handler cleared bus_target
  bus_target = &target;
  for (; i < stop; ++i) {
    if (i + kPrefetchAhead < n) {  // the source of a later string, requested meanwhile
      __builtin_prefetch(base + pos[i + kPrefetchAhead], 0, 0);
      __builtin_prefetch(base + pos[i + kPrefetchAhead] + 64, 0, 0);
    }
    strings[i].resize_uninitialized(static_cast<size_t>(len[i]));
    if (len[i]) std::memcpy(strings[i].mdata(), base + pos[i], static_cast<size_t>(len[i]));
  }
  bus_target = nullptr;
  return true;
}

class GatherBytesOp : public OpKernel {
 public:
  explicit GatherBytesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& starts = ctx->input(1);
    const Tensor& lengths = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(values.shape()),
                absl::InvalidArgumentError("values must be a vector"));
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(starts.shape()) &&
                    TensorShapeUtils::IsVector(lengths.shape()) &&
                    starts.NumElements() == lengths.NumElements(),
                absl::InvalidArgumentError("starts and lengths must be vectors of one length"));
    const int64_t n = starts.NumElements();
    const int64_t size = values.NumElements();
    const int64_t* pos = starts.flat<int64_t>().data();
    const int64_t* len = lengths.flat<int64_t>().data();
    OP_REQUIRES_OK(ctx, CheckFile(ctx->input(3), ctx->input(4)));
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, pos[i] >= 0 && len[i] >= 0 && pos[i] <= size && len[i] <= size - pos[i],
                  absl::InvalidArgumentError(absl::StrCat(
                      "range ", i, " (start ", pos[i], ", length ", len[i],
                      ") lies outside the ", size, " bytes")));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    tstring* strings = out->flat<tstring>().data();
    const char* base = reinterpret_cast<const char*>(values.flat<uint8_t>().data());
    for (int64_t i = 0; i < n;) {
      // Up to kCheckBytes at a time, each stretch after a check of the file: a truncation
      // is mostly seen before the copy that would fault.
      int64_t stop = i, bytes = 0;
      while (stop < n && bytes <= kCheckBytes) bytes += len[stop++] + 64;
      if (i) OP_REQUIRES_OK(ctx, CheckFile(ctx->input(3), ctx->input(4)));
      if (!CopyStrings(strings, base, pos, len, i, stop, n)) {
        OP_REQUIRES_OK(ctx, CheckFile(ctx->input(3), ctx->input(4)));  // names the file
        ctx->CtxFailure(absl::DataLossError(absl::StrCat(
            "the ", size, " mapped bytes the strings are copied from could not be read "
            "(SIGBUS: the file under the map was cut short)")));
        return;
      }
      i = stop;
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("YogastoreGatherBytes").Device(::tensorflow::DEVICE_CPU),
                        GatherBytesOp);

REGISTER_OP("YogastoreJoinBytes")
    .Input("strings: string")
    .Output("values: uint8")
    .Output("lengths: int64")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->NumElements(c->input(0))));
      return absl::OkStatus();
    })
    .Doc(R"doc(The bytes of strings (any shape, row-major) one after another, and their lengths.)doc");

class JoinBytesOp : public OpKernel {
 public:
  explicit JoinBytesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& strings = ctx->input(0);
    const int64_t n = strings.NumElements();
    const tstring* in = strings.flat<tstring>().data();
    Tensor* lengths = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &lengths));
    int64_t* len = lengths->flat<int64_t>().data();
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      len[i] = static_cast<int64_t>(in[i].size());
      total += len[i];
    }
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &values));
    char* out = reinterpret_cast<char*>(values->flat<uint8_t>().data());
    for (int64_t i = 0; i < n; ++i) {
      if (len[i]) std::memcpy(out, in[i].data(), static_cast<size_t>(len[i]));
      out += len[i];
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("YogastoreJoinBytes").Device(::tensorflow::DEVICE_CPU), JoinBytesOp);

}  // namespace
