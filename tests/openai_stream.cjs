// A real client: the official `openai` npm package streams a chat completion through the front door.
// Usage: node openai_stream.cjs BASE_URL PROMPT  -> prints one JSON line {text, chunks, verdict, ttft_ms}
const OpenAI = require('openai');

async function main() {
  const [baseURL, prompt] = process.argv.slice(2);
  const client = new OpenAI({ baseURL, apiKey: 'not-needed' });
  const t0 = Date.now();
  const { data: stream, response } = await client.chat.completions
    .create({ model: 'pdbridge', messages: [{ role: 'user', content: prompt }], stream: true, max_tokens: 16, temperature: 0 })
    .withResponse();
  let text = '', chunks = 0, ttft = null;
  for await (const part of stream) {
    const delta = part.choices?.[0]?.delta?.content ?? '';
    if (delta && ttft === null) ttft = Date.now() - t0;
    text += delta;
    chunks += 1;
  }
  console.log(JSON.stringify({ text, chunks, verdict: JSON.parse(response.headers.get('x-pd-bridge')), ttft_ms: ttft }));
}
main().catch((e) => { console.error(String(e && e.stack || e)); process.exit(1); });
