// TensorFlow kernel of the read bridge (yogastore/train/tf_ops.py builds and loads it).
//
// YogastoreSplitBytes: strings [n] from one uint8 buffer and n + 1 byte offsets,
// string i being values[offsets[i]:offsets[i + 1]]. A batch of strings crosses
// from Python as two arrays; this kernel makes the strings in a tf.data thread,
// with one bounds-checked copy each and no Python object per string.

#include <cstring>

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

REGISTER_OP("YogastoreSplitBytes")
    .Input("values: uint8")
    .Input("offsets: int64")
    .Output("strings: string")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle values;
      shape_inference::ShapeHandle offsets;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &values));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &offsets));
      shape_inference::DimensionHandle n;
      shape_inference::DimensionHandle bounds = c->Dim(offsets, 0);
      if (c->ValueKnown(bounds)) {
        if (c->Value(bounds) < 1) {
          return absl::InvalidArgumentError("offsets must hold at least one element");
        }
        n = c->MakeDim(c->Value(bounds) - 1);
      } else {
        n = c->UnknownDim();
      }
      c->set_output(0, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc("Strings values[offsets[i]:offsets[i + 1]] for i < len(offsets) - 1.");

class SplitBytesOp : public OpKernel {
 public:
  explicit SplitBytesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& offsets = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(values.shape()),
                absl::InvalidArgumentError("values must be a vector"));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(offsets.shape()) && offsets.NumElements() >= 1,
                absl::InvalidArgumentError("offsets must be a vector of at least one element"));
    const int64_t* off = offsets.flat<int64_t>().data();
    const int64_t n = offsets.NumElements() - 1;
    const int64_t size = values.NumElements();
    OP_REQUIRES(ctx, off[0] >= 0 && off[0] <= size,
                absl::InvalidArgumentError(absl::StrCat("offsets[0] = ", off[0],
                                                        " is outside the ", size, " bytes")));
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, off[i] <= off[i + 1] && off[i + 1] <= size,
                  absl::InvalidArgumentError(absl::StrCat(
                      "offsets[", i + 1, "] = ", off[i + 1], " is below offsets[", i, "] = ",
                      off[i], " or past the ", size, " bytes")));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    tstring* strings = out->flat<tstring>().data();
    const char* base = reinterpret_cast<const char*>(values.flat<uint8_t>().data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t len = off[i + 1] - off[i];
      strings[i].resize_uninitialized(static_cast<size_t>(len));
      if (len) std::memcpy(strings[i].mdata(), base + off[i], static_cast<size_t>(len));
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("YogastoreSplitBytes").Device(::tensorflow::DEVICE_CPU),
                        SplitBytesOp);

}  // namespace
