// Drives the real `codespec lsp` (and the daemon it starts) over stdio with
// vscode-languageserver-protocol, the library VS Code's language client is built on:
// initialize, document sync, inline completion, cancellation. Also checks the settings →
// initializationOptions mapping the extension sends.
//
// The server command is `$CODESPEC_PYTHON -m codespec.daemon.cli lsp` (CODESPEC_PYTHON
// defaults to `python3`; point it at the venv that has codespec installed).

import { test, before, after } from 'node:test';
import * as assert from 'node:assert/strict';
import { spawn, ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import {
  CancellationTokenSource,
  createProtocolConnection,
  DidChangeTextDocumentNotification,
  DidOpenTextDocumentNotification,
  ExitNotification,
  InitializedNotification,
  InitializeRequest,
  InlineCompletionRequest,
  InlineCompletionTriggerKind,
  ProtocolConnection,
  ResponseError,
  ShutdownRequest,
  StreamMessageReader,
  StreamMessageWriter,
} from 'vscode-languageserver-protocol/node';
import { initializationOptions, serverCommand, statusText } from '../options';

const PYTHON = process.env.CODESPEC_PYTHON ?? 'python3';
const REQUEST_CANCELLED = -32800;
const TEXT = 'import os\n\n\ndef total(values):\n    result = 0\n    for v in values:\n        result += v\n    return result\n\n\ndef greet(name):\n    ';

let tmp: string;
let socketPath: string;
let server: ChildProcess;
let conn: ProtocolConnection;

function daemonPids(): number[] {
  const pids: number[] = [];
  for (const name of fs.readdirSync('/proc')) {
    if (!/^\d+$/.test(name)) continue;
    try {
      const cmd = fs.readFileSync(`/proc/${name}/cmdline`, 'utf8').split('\0');
      if (cmd.includes('serve') && cmd.includes(socketPath)) pids.push(Number(name));
    } catch {
      // the process ended while we looked
    }
  }
  return pids;
}

async function waitFor<T>(check: () => Promise<T | undefined | false>, ms: number, what: string): Promise<T> {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    const value = await check();
    if (value) return value;
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`timed out waiting for ${what}`);
}

async function requestsStats(): Promise<any> {
  return waitFor(async () => {
    const st: any = await conn.sendRequest('codespec/status', {});
    return st.daemonStats ? st.daemonStats.requests : undefined;
  }, 60000, 'the daemon connection');
}

before(async () => {
  tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'codespec-vscode-'));
  socketPath = path.join(tmp, 'run', 'd.sock');
  server = spawn(PYTHON, ['-m', 'codespec.daemon.cli', 'lsp'], {
    env: {
      ...process.env,
      OMP_NUM_THREADS: '1',
      XDG_CONFIG_HOME: path.join(tmp, 'config'),
      XDG_CACHE_HOME: path.join(tmp, 'cache'),
    },
    stdio: ['pipe', 'pipe', 'inherit'],
  });
  conn = createProtocolConnection(
    new StreamMessageReader(server.stdout!),
    new StreamMessageWriter(server.stdin!),
  );
  conn.listen();
});

after(async () => {
  try {
    await conn.sendRequest(ShutdownRequest.type);
    await conn.sendNotification(ExitNotification.type);
  } catch {
    server.kill();
  }
  conn.dispose();
  for (const pid of daemonPids()) process.kill(pid, 'SIGTERM');
  // A terminated daemon saves its index under tmp/cache on the way out:
  // removing tmp before it has exited races with that write (ENOTEMPTY).
  await waitFor(async () => daemonPids().length === 0, 30000, 'the daemon to exit');
  fs.rmSync(tmp, { recursive: true, force: true, maxRetries: 5, retryDelay: 100 });
});

test('settings are mirrored into initializationOptions', () => {
  const settings: Record<string, unknown> = { maxTokens: 32, multiline: 'never', socket: null, unrelated: 1 };
  assert.deepEqual(initializationOptions((k) => settings[k]), { maxTokens: 32, multiline: 'never' });
  assert.deepEqual(serverCommand(() => ['/opt/codespec', 'lsp', '--log-level', 'INFO']), {
    command: '/opt/codespec',
    args: ['lsp', '--log-level', 'INFO'],
  });
  assert.deepEqual(serverCommand(() => undefined), { command: 'codespec', args: ['lsp'] });
  assert.equal(
    statusText({ connected: true, completions: { shown: 4, accepted: 1, acceptance_rate: 0.25, tokens_per_s: 81.4 } }),
    '$(sparkle) codespec 81 tok/s · 25% accepted',
  );
});

test('initialize advertises inline completion in UTF-16', async () => {
  const result = await conn.sendRequest(InitializeRequest.type, {
    processId: process.pid,
    rootUri: null,
    capabilities: {
      general: { positionEncodings: ['utf-8', 'utf-16'] },
      textDocument: { inlineCompletion: {} },
    },
    initializationOptions: { socket: socketPath, debounceMs: 0, maxTokens: 24, startTimeout: 60 },
  });
  await conn.sendNotification(InitializedNotification.type, {});
  assert.ok(result.capabilities.inlineCompletionProvider);
  assert.equal(result.capabilities.positionEncoding, 'utf-16');
  assert.equal((result.capabilities.textDocumentSync as any).change, 2);
});

test('document sync and inline completion', async () => {
  const uri = 'file://' + path.join(tmp, 'sync.py');
  await conn.sendNotification(DidOpenTextDocumentNotification.type, {
    textDocument: { uri, languageId: 'python', version: 1, text: TEXT },
  });
  // Type a new line inside total(): incremental change, then complete after it.
  await conn.sendNotification(DidChangeTextDocumentNotification.type, {
    textDocument: { uri, version: 2 },
    contentChanges: [
      { range: { start: { line: 4, character: 14 }, end: { line: 4, character: 14 } }, text: '\n    count = ' },
    ],
  });
  let produced = 0;
  for (const [line, character] of [[5, 12], [11, 4], [3, 18]]) {
    for (const triggerKind of [InlineCompletionTriggerKind.Invoked, InlineCompletionTriggerKind.Automatic]) {
      const result: any = await conn.sendRequest(InlineCompletionRequest.type, {
        textDocument: { uri },
        position: { line, character },
        context: { triggerKind },
      });
      const items = Array.isArray(result) ? result : result.items;
      assert.ok(items.length <= (triggerKind === InlineCompletionTriggerKind.Invoked ? 3 : 1));
      for (const item of items) {
        assert.equal(typeof item.insertText, 'string');
        assert.ok(item.insertText.trim().length > 0, 'whitespace-only item');
        assert.equal(item.command.command, 'codespec.acceptCompletion');
      }
      produced += items.length;
    }
  }
  assert.ok(produced > 0, 'no position produced an item');
  // The daemon holds the document at the version the client last sent.
  const st: any = await conn.sendRequest('codespec/status', {});
  assert.equal(st.connected, true);
  assert.equal(st.daemonStats.documents, 1);
});

test('a cancelled inline completion returns quickly with RequestCancelled', async () => {
  const uri = 'file://' + path.join(tmp, 'cancel.py');
  await conn.sendNotification(DidOpenTextDocumentNotification.type, {
    textDocument: { uri, languageId: 'python', version: 1, text: TEXT },
  });
  const before = await requestsStats();
  const source = new CancellationTokenSource();
  const pending = conn.sendRequest(
    InlineCompletionRequest.type,
    {
      textDocument: { uri },
      position: { line: 11, character: 4 },
      context: { triggerKind: InlineCompletionTriggerKind.Invoked },
    },
    source.token,
  );
  await waitFor(async () => (await requestsStats()).in_flight > 0, 20000, 'the daemon to start');
  const t0 = Date.now();
  source.cancel();
  await assert.rejects(pending, (err: unknown) => {
    assert.ok(err instanceof ResponseError);
    assert.equal(err.code, REQUEST_CANCELLED);
    return true;
  });
  assert.ok(Date.now() - t0 < 2000, `cancellation took ${Date.now() - t0} ms`);
  const after = await waitFor(async () => {
    const r = await requestsStats();
    return r.in_flight + r.queued === 0 ? r : undefined;
  }, 10000, 'an idle daemon');
  assert.ok(after.cancelled > before.cancelled, 'the daemon request was not cancelled');
});
