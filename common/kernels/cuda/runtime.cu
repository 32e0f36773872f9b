#include "common/kernels/cuda/runtime.cuh"

#include <cuda_runtime.h>

#include <cstring>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

const char* ErrorString(int code) {
  if (code >= kBlasErrorBase) return "cuBLAS call failed (status = code - kBlasErrorBase)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int SetDevice(int device) { return cudaSetDevice(device); }
int GetDevice(int* device) { return cudaGetDevice(device); }

int Malloc(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
int Free(void* ptr) { return cudaFree(ptr); }
int Memset(void* ptr, int value, size_t bytes, void* stream) {
  return cudaMemsetAsync(ptr, value, bytes, AsStream(stream));
}
int CopyToDevice(void* dst, const void* src, size_t bytes, void* stream) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, AsStream(stream));
}
int CopyToHost(void* dst, const void* src, size_t bytes, void* stream) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, AsStream(stream));
}
int CopyOnDevice(void* dst, const void* src, size_t bytes, void* stream) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, AsStream(stream));
}
int Copy2DToHost(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                 size_t rows, void* stream) {
  return cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToHost,
                           AsStream(stream));
}
int Copy2DToDevice(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                   size_t rows, void* stream) {
  return cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyHostToDevice,
                           AsStream(stream));
}
int StreamCreate(void** stream) {
  cudaStream_t s = nullptr;
  const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *stream = s;
  return e;
}
int StreamDestroy(void* stream) { return cudaStreamDestroy(AsStream(stream)); }
int StreamSynchronize(void* stream) { return cudaStreamSynchronize(AsStream(stream)); }
int HostAlloc(void** ptr, size_t bytes) { return cudaMallocHost(ptr, bytes); }
int HostFree(void* ptr) { return cudaFreeHost(ptr); }
int EventCreate(void** event) {
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  *event = e;
  return err;
}
int EventDestroy(void* event) { return cudaEventDestroy(static_cast<cudaEvent_t>(event)); }
int EventRecord(void* event, void* stream) {
  return cudaEventRecord(static_cast<cudaEvent_t>(event), AsStream(stream));
}
int StreamWaitEvent(void* stream, void* event) {
  return cudaStreamWaitEvent(AsStream(stream), static_cast<cudaEvent_t>(event), 0);
}
int EventSynchronize(void* event) { return cudaEventSynchronize(static_cast<cudaEvent_t>(event)); }
bool EventPending(void* event) {
  if (cudaEventQuery(static_cast<cudaEvent_t>(event)) != cudaErrorNotReady) return false;
  (void)cudaGetLastError();  // "not ready" is no error: keep it from a later launch's check
  return true;
}
int GraphCaptureBegin(void* stream) {
  return cudaStreamBeginCapture(AsStream(stream), cudaStreamCaptureModeThreadLocal);
}
int GraphCaptureEnd(void* stream, void** exec) {
  *exec = nullptr;
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamEndCapture(AsStream(stream), &graph);
  if (e != cudaSuccess) return e;
  cudaGraphExec_t g = nullptr;
  e = cudaGraphInstantiate(&g, graph, 0);
  cudaGraphDestroy(graph);
  if (e == cudaSuccess) *exec = g;
  return e;
}
int GraphLaunch(void* exec, void* stream) {
  return cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), AsStream(stream));
}
int GraphDestroy(void* exec) { return cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec)); }
int IpcExport(void* ptr, char (&handle)[kIpcHandleBytes]) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes);
  cudaIpcMemHandle_t h;
  const cudaError_t e = cudaIpcGetMemHandle(&h, ptr);
  std::memcpy(handle, &h, sizeof(h));
  return e;
}
int IpcOpen(const char (&handle)[kIpcHandleBytes], void** ptr) {
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}
int IpcClose(void* ptr) { return cudaIpcCloseMemHandle(ptr); }
int CopyPeer(void* dst, const void* src, size_t bytes, void* stream) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, AsStream(stream));
}
int DevicePciBusId(char* id, int len) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return cudaDeviceGetPCIBusId(id, len, device);
}

int MemoryInfo(size_t* free_bytes, size_t* total_bytes) {
  return cudaMemGetInfo(free_bytes, total_bytes);
}

}  // namespace preft::kernels::cuda
