// The AI SDK's calls on ft, one task per run (tests/clients/test_ai_sdk.py): prints one JSON line.
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { generateObject, generateText, jsonSchema, Output, stepCountIs, streamText, tool } from 'ai';
globalThis.AI_SDK_LOG_WARNINGS = false;
const [baseURL, modelId, task] = process.argv.slice(2);
const ft = createOpenAICompatible({ name: 'ft', baseURL, apiKey: 'ft-local-test-key', supportsStructuredOutputs: true });
const common = { model: ft(modelId), maxOutputTokens: 128, temperature: 0, maxRetries: 0 };
const city = jsonSchema({
  type: 'object', properties: { name: { type: 'string' }, country: { type: 'string' } },
  required: ['name', 'country'], additionalProperties: false,
});
let out;
if (task === 'text') {
  const r = await generateText({ ...common, prompt: 'Say hello.' });
  out = { text: r.text, finishReason: r.finishReason };
} else if (task === 'stream') {
  const r = streamText({ ...common, prompt: 'Say hello.' });
  let parts = 0;
  for await (const _ of r.textStream) parts++;
  out = { parts, finishReason: await r.finishReason };
} else if (task === 'tool') {
  const executed = [];
  const get_weather = tool({
    description: 'The weather in a city.',
    inputSchema: jsonSchema({ type: 'object', properties: { city: { type: 'string' } }, required: ['city'] }),
    execute: async ({ city }) => { executed.push(city); return 'sunny'; },
  });
  const r = await generateText({
    ...common, prompt: 'What is the weather in Paris?', tools: { get_weather },
    toolChoice: { type: 'tool', toolName: 'get_weather' }, stopWhen: stepCountIs(1),
  });
  out = { toolCalls: r.toolCalls.map((c) => c.toolName), executed: executed.length, finishReason: r.finishReason };
} else if (task === 'object') {
  const r = await generateObject({ ...common, schema: city, prompt: 'Name a city and its country.' });
  out = { object: r.object, finishReason: r.finishReason };
} else if (task === 'output') {
  const r = await generateText({ ...common, output: Output.object({ schema: city }), prompt: 'Name a city.' });
  out = { object: r.output, finishReason: r.finishReason };
}
console.log(JSON.stringify(out));
