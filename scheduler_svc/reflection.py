"""gRPC server reflection, both protocol versions, for the public and the Admin server.

grpcio-reflection implements only `grpc.reflection.v1alpha.ServerReflection` (grpc/grpc#38576),
while grpcurl, grpc_cli and Java's reflection clients try `grpc.reflection.v1` first and
Postman speaks only v1alpha. The v1 protocol is the v1alpha one under a new package: the same
messages with the same field numbers, so the same bytes on the wire. So v1 is served here by
grpcio-reflection's own servicer, under the v1 method name, and v1's descriptors (v1alpha's
renamed) are added to the default pool so that `grpcurl describe grpc.reflection.v1...` works too.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptors(pool: descriptor_pool.DescriptorPool) -> None:
    """Adds grpc/reflection/v1/reflection.proto to `pool`: v1alpha's file, renamed (once)."""
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return  # already there (a second server in this process, or a library that ships it)
    except KeyError:
        pass
    old = v1alpha_pb2.DESCRIPTOR.package
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message fields only: setting it on a scalar is an error
                field.type_name = field.type_name.replace(f".{old}.", f".{V1_PACKAGE}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(f".{old}.", f".{V1_PACKAGE}.")
        method.output_type = method.output_type.replace(f".{old}.", f".{V1_PACKAGE}.")
    pool.Add(proto)


def enable_reflection(server: grpc.aio.Server, *service_names: str) -> None:
    """Serves reflection v1 and v1alpha on `server`, listing `service_names` and both of them."""
    pool = descriptor_pool.Default()
    _add_v1_descriptors(pool)
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names, pool=pool)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": method}),)
    )
    reflection.enable_server_reflection(names, server, pool=pool)
