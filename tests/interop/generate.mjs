// A Node.js client of pagedserve's public API (@grpc/grpc-js + @grpc/proto-loader, pinned in
// package.json), run by tests/stack/test_interop.py:
//   node tests/interop/generate.mjs HOST:PORT '{"prompt_token_ids": {"ids": [5, 6]}, ...}'
// Calls ListModels, then Generate with the given GenerateRequest (JSON, proto field names), and
// prints one JSON object: {"models": [...], "responses": [...], "token_ids": [...], "text": ...}.
// Exits 1 with {"error": {"code", "details"}} on an RPC error.
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const require = createRequire(import.meta.url);
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "protos");
const definition = protoLoader.loadSync("pagedserve/v1/api.proto", {
  includeDirs: [root], keepCase: true, longs: Number, enums: String, defaults: true,
  oneofs: true,
});
const { GenerationService } = grpc.loadPackageDefinition(definition).pagedserve.v1;

const [address, requestJson] = process.argv.slice(2);
const client = new GenerationService(address, grpc.credentials.createInsecure());
const deadline = () => new Date(Date.now() + 60_000);

function fail(err) {
  console.log(JSON.stringify({ error: { code: err.code, details: err.details } }));
  process.exit(1);
}

const models = await new Promise((resolve, reject) =>
  client.ListModels({}, { deadline: deadline() }, (err, res) => (err ? reject(err) : resolve(res))),
).catch(fail);

const responses = [];
await new Promise((resolve, reject) => {
  const call = client.Generate(JSON.parse(requestJson), { deadline: deadline() });
  call.on("data", (msg) => responses.push(msg));
  call.on("error", reject);
  call.on("end", resolve);
}).catch(fail);

client.close();
console.log(JSON.stringify({
  models: models.models,
  responses,
  token_ids: responses.flatMap((r) => r.token_ids),
  text: responses.map((r) => r.text).join(""),
}));
