#pragma once

// Device memory, streams and errors for the CUDA kernels. Callers outside common/kernels/cuda
// see no CUDA types: streams travel as void* (a cudaStream_t; nullptr is the default stream)
// and every call returns 0 or the CUDA error code, which ErrorString names.

#include <cstddef>
#include <cstdint>

namespace preft::kernels::cuda {

// cuBLAS failures are returned as kBlasErrorBase + cublasStatus_t, apart from CUDA's codes.
inline constexpr int kBlasErrorBase = 100000;

// Number of CUDA devices visible (0 without a GPU or driver).
int DeviceCount();
// Names a code returned by any function here (CUDA's message, or the cuBLAS status).
const char* ErrorString(int code);
// The calling thread's current device: where its allocations, streams and kernels go (each
// thread starts on device 0; a tensor-parallel rank's thread sets its own).
int SetDevice(int device);
int GetDevice(int* device);

int Malloc(void** ptr, size_t bytes);
int Free(void* ptr);
// Fills bytes with `value` (tests poison outputs with 0xff: NaN in f32 and bf16).
int Memset(void* ptr, int value, size_t bytes, void* stream);
int CopyToDevice(void* dst, const void* src, size_t bytes, void* stream);
int CopyToHost(void* dst, const void* src, size_t bytes, void* stream);
int CopyOnDevice(void* dst, const void* src, size_t bytes, void* stream);
// `rows` rows of `width` bytes, `src_pitch` and `dst_pitch` bytes apart.
int Copy2DToHost(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                 size_t rows, void* stream);
int Copy2DToDevice(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                   size_t rows, void* stream);
int StreamCreate(void** stream);
int StreamDestroy(void* stream);
int StreamSynchronize(void* stream);

// Page-locked host memory: copies from it to the device run asynchronously (a copy from
// pageable memory is staged by the driver and returns only once staged).
int HostAlloc(void** ptr, size_t bytes);
int HostFree(void* ptr);

// Events order work across streams: Record marks the point `stream` has reached, WaitEvent
// makes `stream` wait on the device (the host never blocks) until that point is passed.
int EventCreate(void** event);
int EventDestroy(void* event);
int EventRecord(void* event, void* stream);
int StreamWaitEvent(void* stream, void* event);
int EventSynchronize(void* event);
// True while the work recorded before `event` is still running (never blocks); an error
// counts as done, for the work that uses it to report.
bool EventPending(void* event);

// CUDA graphs: the work queued on `stream` between CaptureBegin and CaptureEnd is recorded,
// not run, and *exec becomes an executable graph (a cudaGraphExec_t) that GraphLaunch replays
// with one launch. CaptureEnd always ends the capture; *exec is null on error.
int GraphCaptureBegin(void* stream);
int GraphCaptureEnd(void* stream, void** exec);
int GraphLaunch(void* exec, void* stream);
int GraphDestroy(void* exec);

// CUDA IPC: another process on the same node maps a device allocation through a 64-byte
// handle. IpcExport writes the handle of the allocation that starts at `ptr`; IpcOpen maps a
// peer's (enabling peer access when it lives on another GPU); IpcClose unmaps it.
inline constexpr size_t kIpcHandleBytes = 64;
int IpcExport(void* ptr, char (&handle)[kIpcHandleBytes]);
int IpcOpen(const char (&handle)[kIpcHandleBytes], void** ptr);
int IpcClose(void* ptr);
// A copy between any two device pointers (this GPU's, a peer GPU's, or one IpcOpen mapped).
int CopyPeer(void* dst, const void* src, size_t bytes, void* stream);
// The current device's PCI bus id ("0000:3b:00.0"): names a GPU across processes.
int DevicePciBusId(char* id, int len);

// Free and total device memory of the current device, in bytes.
int MemoryInfo(size_t* free_bytes, size_t* total_bytes);

}  // namespace preft::kernels::cuda
