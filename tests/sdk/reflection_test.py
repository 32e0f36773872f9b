#!/usr/bin/env python3
"""gRPC server reflection on a running server (`preft serve`), through a client built here from
grpc-proto's reflection.proto with grpc_tools: the services are listed and preft.v1.Preft's
descriptors come back, so generic tools (grpcurl, Postman) work without our .proto files.

Usage: reflection_test.py BUILD_DIR WORK_DIR
"""
import os
import re
import shutil
import subprocess
import sys
import time

import grpc
from grpc_tools import protoc
from google.protobuf import descriptor_pb2


def main():
    build, work = sys.argv[1:3]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    # Copied to the top of `work`: generated as modules of its own ("reflection_pb2"), not under
    # the installed `grpc` package's name. The proto package (the wire name) is unchanged.
    shutil.copy("/usr/share/grpc-proto/grpc/reflection/v1alpha/reflection.proto", work)
    rc = protoc.main(["protoc", f"-I{work}", f"--python_out={work}", f"--grpc_python_out={work}",
                      f"{work}/reflection.proto"])
    if rc != 0:
        print("FAIL: could not generate the reflection client")
        return 1
    sys.path.insert(0, work)
    import reflection_pb2  # noqa: E402
    import reflection_pb2_grpc  # noqa: E402

    preft = f"{build}/tools/preft"
    subprocess.run([preft, "make-model", "--preset", "tiny", "--seed", "2", "--out",
                    f"{work}/model"], check=True, capture_output=True)
    server = subprocess.Popen([preft, "serve", "--model", f"{work}/model", "--listen",
                               "127.0.0.1:0", "--threads", "1"],
                              stdout=subprocess.PIPE, text=True)
    failures = 0
    try:
        address = None
        deadline = time.time() + 60
        while address is None and time.time() < deadline:
            line = server.stdout.readline()
            m = re.search(r"listening on (\S+)", line)
            if m:
                address = m.group(1)
        if address is None:
            print("FAIL: preft serve did not start")
            return 1
        stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(address))

        def ask(**kw):
            req = reflection_pb2.ServerReflectionRequest(**kw)
            return next(iter(stub.ServerReflectionInfo(iter([req]), timeout=10)))

        names = {s.name for s in ask(list_services="").list_services_response.service}
        for want in ("preft.v1.Preft", "grpc.health.v1.Health"):
            ok = want in names
            failures += not ok
            print(f"{'ok' if ok else 'FAIL'}: {want} listed ({sorted(names)})")
        files = ask(file_containing_symbol="preft.v1.Preft").file_descriptor_response
        methods = set()
        for raw in files.file_descriptor_proto:
            fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
            for svc in fd.service:
                if svc.name == "Preft":
                    methods.update(m.name for m in svc.method)
        ok = {"Generate", "ListModels", "RegisterAdapter", "UpdateAdapter"} <= methods
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'}: preft.v1.Preft methods described: {sorted(methods)}")
        missing = ask(file_containing_symbol="no.such.Service")
        ok = missing.HasField("error_response") and missing.error_response.error_code == 5
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'}: an unknown symbol is NOT_FOUND")
    finally:
        server.terminate()
        server.wait(30)
    print(f"reflection: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
