// hyperparallel._C: the core's fully_shard for the Python front-end (hyperparallel/*.py).
// Every call that may wait on a collective releases the GIL: ranks may be threads of one
// process, and a Python thread's hook may run while another waits.
#include <c10/util/Exception.h>
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "hyperparallel/comm_codec.h"
#include "shard_state.h"
#include "torch_groups.h"

namespace py = pybind11;
using hp::python::ShardState;
using hp::python::ShardStatePtr;

namespace {

// LibTorch's error types as the Python exceptions torch raises for them.
void translate_errors(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

void bind_groups(py::module_& m) {
  py::class_<hp::Group, hp::GroupPtr>(m, "Group");  // opaque: passed back into the core
  m.def("adopt_process_group", &hp::python::adopt_process_group, py::arg("process_group"),
        py::arg("ranks"), py::arg("device"), py::arg("timeout"));
  m.def("group_of_one", &hp::python::group_of_one, py::arg("rank"), py::arg("device"),
        py::arg("timeout"));
  py::class_<hp::python::MeshGroups>(m, "MeshGroups")
      .def(py::init([](std::vector<std::string> dims, hp::GroupPtr shard, hp::GroupPtr shard_reduce,
                       hp::GroupPtr replicate, hp::GroupPtr data_parallel, c10::Device device) {
             return hp::python::MeshGroups{std::move(dims),          std::move(shard),
                                           std::move(shard_reduce),  std::move(replicate),
                                           std::move(data_parallel), device};
           }),
           py::arg("dims"), py::arg("shard"), py::arg("shard_reduce"), py::arg("replicate"),
           py::arg("data_parallel"), py::arg("device"));
}

// The core's option structs, field by field as the C++ API names them.
void bind_options(py::module_& m) {
  py::enum_<hp::CommCodec>(m, "CommCodec")
      .value("none", hp::CommCodec::kNone)
      .value("int8", hp::CommCodec::kInt8)
      .value("fp8", hp::CommCodec::kFp8);
  m.def("parse_comm_codec", &hp::parse_comm_codec);
  py::class_<hp::MixedPrecisionPolicy>(m, "MixedPrecisionPolicy")
      .def_readwrite("param_dtype", &hp::MixedPrecisionPolicy::param_dtype)
      .def_readwrite("reduce_dtype", &hp::MixedPrecisionPolicy::reduce_dtype)
      .def_readwrite("output_dtype", &hp::MixedPrecisionPolicy::output_dtype)
      .def_readwrite("cast_forward_inputs", &hp::MixedPrecisionPolicy::cast_forward_inputs);
  py::class_<hp::OffloadPolicy>(m, "OffloadPolicy")
      .def_readwrite("offload", &hp::OffloadPolicy::offload)
      .def_readwrite("pin_memory", &hp::OffloadPolicy::pin_memory);
  py::class_<hp::CommPolicy>(m, "CommPolicy")
      .def_readwrite("all_gather_codec", &hp::CommPolicy::all_gather_codec)
      .def_readwrite("reduce_scatter_codec", &hp::CommPolicy::reduce_scatter_codec)
      .def_readwrite("block_size", &hp::CommPolicy::block_size)
      .def_readwrite("error_feedback", &hp::CommPolicy::error_feedback);
  py::class_<hp::FullyShardOptions>(m, "FullyShardOptions")
      .def_readwrite("mp_policy", &hp::FullyShardOptions::mp_policy)
      .def_readwrite("offload_policy", &hp::FullyShardOptions::offload_policy)
      .def_readwrite("comm_policy", &hp::FullyShardOptions::comm_policy)
      .def_readwrite("ignored_params", &hp::FullyShardOptions::ignored_params)
      .def_readwrite("replicate_params", &hp::FullyShardOptions::replicate_params)
      .def_readwrite("comm_fusion", &hp::FullyShardOptions::comm_fusion)
      .def_readwrite("comm_fusion_bucket_bytes", &hp::FullyShardOptions::comm_fusion_bucket_bytes);
  py::class_<hp::python::ShardOptions>(m, "ShardOptions")
      .def(py::init<>())
      .def_readwrite("core", &hp::python::ShardOptions::core)
      .def_readwrite("reshard_after_forward", &hp::python::ShardOptions::reshard_after_forward)
      .def_readwrite("post_forward_group", &hp::python::ShardOptions::post_forward_group)
      .def_readwrite("placements", &hp::python::ShardOptions::placements);
}

void bind_module(py::module_& m) {
  using hp::FSDPModule;
  py::class_<hp::CommHandle>(m, "CommHandle")
      .def("wait", &hp::CommHandle::wait, py::call_guard<py::gil_scoped_release>());
  py::class_<FSDPModule>(m, "FSDPModuleCore")
      .def("unshard", &FSDPModule::unshard, py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def("reshard", &FSDPModule::reshard, py::call_guard<py::gil_scoped_release>())
      .def("set_requires_gradient_sync", &FSDPModule::set_requires_gradient_sync)
      .def("set_requires_all_reduce", &FSDPModule::set_requires_all_reduce)
      .def("set_reshard_after_forward", &FSDPModule::set_reshard_after_forward)
      .def("set_reshard_after_backward", &FSDPModule::set_reshard_after_backward)
      .def("set_is_last_backward", &FSDPModule::set_is_last_backward)
      .def("set_modules_to_forward_prefetch", &FSDPModule::set_modules_to_forward_prefetch)
      .def("set_modules_to_backward_prefetch", &FSDPModule::set_modules_to_backward_prefetch)
      .def("set_gradient_divide_factor", &FSDPModule::set_gradient_divide_factor);
}

void bind_state(py::module_& m) {
  py::class_<hp::python::ShardedParamView>(m, "ShardedParamView")
      .def_readonly("name", &hp::python::ShardedParamView::name)
      .def_readonly("variable", &hp::python::ShardedParamView::variable)
      .def_readonly("local", &hp::python::ShardedParamView::local)
      .def_readonly("shard_dim", &hp::python::ShardedParamView::shard_dim)
      .def_readonly("global_shape", &hp::python::ShardedParamView::global_shape);
  py::class_<ShardState, ShardStatePtr>(m, "ShardState")
      .def(py::init<std::vector<std::pair<std::string, at::Tensor>>, std::vector<at::Tensor>,
                    const hp::python::MeshGroups&, hp::python::ShardOptions,
                    const std::vector<ShardStatePtr>&, hp::python::SubtreeFn>(),
           py::arg("named"), py::arg("taken"), py::arg("groups"), py::arg("options"),
           py::arg("existing"), py::arg("subtree"))
      .def("pre_forward", &ShardState::pre_forward, py::call_guard<py::gil_scoped_release>())
      .def("post_forward", &ShardState::post_forward, py::call_guard<py::gil_scoped_release>())
      .def("forward_failed", &ShardState::forward_failed, py::call_guard<py::gil_scoped_release>())
      .def("is_unsharded", &ShardState::is_unsharded)
      .def("sharded_params", &ShardState::sharded_params)
      .def("move_shard", &ShardState::move_shard)
      .def("module", &ShardState::module);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  py::register_local_exception_translator(&translate_errors);
  bind_groups(m);
  bind_options(m);
  bind_module(m);
  bind_state(m);
}
