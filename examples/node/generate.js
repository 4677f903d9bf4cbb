// Streams one chunkserve Generate call over gRPC: npm install && node generate.js [host:port] [prompt]
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO = path.join(__dirname, "..", "..", "protos", "chunkserve", "v1", "chunkserve.proto");
// keepCase keeps the proto's snake_case names (max_tokens, request_id): without it the loader
// expects camelCase, and a snake_case field is dropped without an error. See the README.
const options = { keepCase: true, enums: String, longs: String, defaults: true, oneofs: true };
const { Generation } = grpc.loadPackageDefinition(protoLoader.loadSync(PROTO, options)).chunkserve.v1;

const client = new Generation(process.argv[2] || "localhost:50051", grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
if (process.env.CHUNKSERVE_API_KEY) metadata.set("authorization", `Bearer ${process.env.CHUNKSERVE_API_KEY}`);
const request = {
  text: process.argv[3] || "Once upon a time",
  sampling: { max_tokens: 32, temperature: 0.7, seed: 1 }, // unset max_tokens means 16
  client_request_id: "node-example",
};
const call = client.Generate(request, metadata);
call.on("data", (msg) => {
  if (msg.client_request_id) console.error(`[${msg.request_id}: ${msg.prompt_tokens} prompt tokens]`);
  process.stdout.write(msg.text);
  if (msg.finished) {
    console.error(`\n[${msg.finish_reason}; completion ${msg.usage.completion_tokens} tokens, ` +
      `${msg.usage.cached_tokens} of ${msg.usage.prompt_tokens} prompt tokens cached]`);
  }
});
call.on("error", (err) => {
  console.error(`generate.js: ${grpc.status[err.code]}: ${err.details}`);
  process.exitCode = 1;
});
call.on("end", () => client.close());
