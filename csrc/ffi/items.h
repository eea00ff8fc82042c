// vmap's batch in one custom call (vmap_method="expand_dims"): a handler wrapped in
// EachItem<kItemRank> receives its buffers with leading batch dimensions and runs its decoder and
// implementation once per item, on views of the buffers at that item, so every item's outputs
// are written in place (a sequential vmap would loop in XLA over zero-filled stacks instead).
//
// The leading dimensions are those of the first buffer argument beyond kItemRank, the rank of
// one item's first argument; none, and the call runs as it is. Every result has the batch's
// sizes there; an argument has them or 1 (vmap did not batch it: every item reads the same).
#pragma once

#include <deque>
#include <type_traits>
#include <vector>

#include "common.h"

namespace jax_fp8 {

template <typename T>
struct IsBuffer : std::false_type {};
template <>
struct IsBuffer<ffi::AnyBuffer> : std::true_type {};
template <ffi::DataType dtype, size_t rank>
struct IsBuffer<ffi::Buffer<dtype, rank>> : std::true_type {};

template <typename T>
struct IsResult : std::false_type {};
template <typename T>
struct IsResult<ffi::Result<T>> : std::true_type {};

// The batch of a call: its leading dimensions' sizes (from the first result) and item count.
struct Batch {
  std::vector<int64_t> dims;
  int64_t count = 1;
};

// Views of a call's bound values at one item: buffers (results and remaining arguments
// included) advanced to the item and without the leading dimensions; anything else as it is.
// The views live as long as this object.
class ItemViews {
 public:
  ItemViews(const Batch& batch, int64_t item) : batch_(batch), index_(batch.dims.size()) {
    for (size_t k = batch.dims.size(); k-- > 0; item /= batch.dims[k])
      index_[k] = item % batch.dims[k];
  }

  ffi::AnyBuffer operator()(ffi::AnyBuffer b) { return ffi::AnyBuffer(View(b)); }
  template <ffi::DataType dtype, size_t rank>
  ffi::Buffer<dtype, rank> operator()(ffi::Buffer<dtype, rank> b) {
    return ffi::Buffer<dtype, rank>(View(b));
  }
  template <typename T>
  ffi::Result<T> operator()(ffi::Result<T> r) {
    return ffi::Result<T>((*this)(*r));
  }
  ffi::RemainingArgs operator()(ffi::RemainingArgs more) {
    RemainingViews& v = remaining_.emplace_back();
    for (size_t i = 0; i < more.size(); ++i) {
      v.types.push_back(XLA_FFI_ArgType_BUFFER);
      v.args.push_back(const_cast<XLA_FFI_Buffer*>(View(*more.get<ffi::AnyBuffer>(i))));
    }
    v.list = XLA_FFI_Args{};  // fields by name: the C API's order is not relied on
    v.list.struct_size = XLA_FFI_Args_STRUCT_SIZE;
    v.list.size = int64_t(v.args.size());
    v.list.types = v.types.data();
    v.list.args = v.args.data();
    return ffi::RemainingArgs(&v.list, 0);
  }
  template <typename T>
  T operator()(T value) {  // an attribute, the stream
    return value;
  }

 private:
  struct RemainingViews {
    std::vector<XLA_FFI_ArgType> types;
    std::vector<void*> args;
    XLA_FFI_Args list;
  };

  template <typename B>
  const XLA_FFI_Buffer* View(const B& b) {
    const auto dims = b.dimensions();
    const size_t lead = batch_.dims.size();
    int64_t item_elems = 1, offset = 0;
    for (size_t k = lead; k < dims.size(); ++k) item_elems *= dims[k];
    for (size_t k = 0; k < lead; ++k) offset = offset * dims[k] + (dims[k] == 1 ? 0 : index_[k]);
    auto* data = static_cast<char*>(b.untyped_data()) +
                 offset * item_elems * int64_t(ffi::ByteWidth(b.element_type()));
    XLA_FFI_Buffer& view = views_.emplace_back();  // value-initialized, fields by name
    view.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    view.dtype = static_cast<XLA_FFI_DataType>(b.element_type());
    view.data = data;
    view.rank = int64_t(dims.size() - lead);
    view.dims = const_cast<int64_t*>(dims.begin() + lead);
    return &view;
  }

  const Batch& batch_;
  std::vector<int64_t> index_;  // the item's index in each leading dimension
  std::deque<XLA_FFI_Buffer> views_;
  std::deque<RemainingViews> remaining_;
};

template <int kItemRank, typename Call>
struct EachItem {
  Call call;

  template <typename... Bound>
  ffi::Error operator()(Bound... bound) const {
    int lead = -1;  // the first buffer argument's leading dimensions
    ((lead < 0 && IsBuffer<Bound>::value ? lead = Rank(bound) - kItemRank : 0), ...);
    if (lead <= 0) return call(bound...);
    Batch batch;
    bool found = false;  // the first result's leading dimensions are the batch's
    ((!found && IsResult<Bound>::value ? found = FirstDims(bound, lead, batch) : false), ...);
    ffi::Error error = ffi::Error::Success();
    ((error = error.failure() ? error : Check(bound, batch, false)), ...);
    if (error.failure()) return error;
    for (int64_t i = 0; i < batch.count; ++i) {
      ItemViews views(batch, i);
      if (ffi::Error e = call(views(bound)...); e.failure()) return e;
    }
    return ffi::Error::Success();
  }

 private:
  template <typename T>
  static int Rank(const T& b) {
    if constexpr (IsBuffer<T>::value) return int(b.dimensions().size());
    return 0;
  }

  template <typename T>
  static bool FirstDims(T r, int lead, Batch& batch) {
    if constexpr (IsResult<T>::value) {
      const auto dims = r->dimensions();
      for (int k = 0; k < lead && k < int(dims.size()); ++k) {
        batch.dims.push_back(dims[k]);
        batch.count *= dims[k];
      }
      return true;
    }
    return false;
  }

  // A buffer's leading dimensions: the batch's, or 1 in an argument's.
  static ffi::Error CheckDims(ffi::AnyBuffer::Dimensions dims, const Batch& batch, bool result) {
    const size_t lead = batch.dims.size();
    bool ok = dims.size() >= lead;
    for (size_t k = 0; ok && k < lead; ++k)
      ok = dims[k] == batch.dims[k] || (!result && dims[k] == 1);
    return ok ? ffi::Error::Success()
              : invalid("every buffer of a batched call must lead with the batch's dimensions "
                        "(an argument's may be 1)");
  }

  template <typename T>
  static ffi::Error Check(T value, const Batch& batch, bool result) {
    if constexpr (IsResult<T>::value) {
      return Check(*value, batch, true);
    } else if constexpr (IsBuffer<T>::value) {
      return CheckDims(value.dimensions(), batch, result);
    } else if constexpr (std::is_same_v<T, ffi::RemainingArgs>) {
      for (size_t i = 0; i < value.size(); ++i) {
        ffi::ErrorOr<ffi::AnyBuffer> b = value.template get<ffi::AnyBuffer>(i);
        if (!b.has_value()) return b.error();
        if (ffi::Error e = CheckDims(b->dimensions(), batch, false); e.failure()) return e;
      }
    }
    return ffi::Error::Success();
  }
};

// `call` (a DecodeThen) run once per item of vmap's batch; kItemRank: the rank of one item's
// first buffer argument.
template <int kItemRank, typename Call>
EachItem<kItemRank, Call> each_item(Call call) {
  return {call};
}

}  // namespace jax_fp8
