// codespec VS Code extension: inline completions and "Rewrite selection" from a local model.
//
// Owns: starting `codespec lsp` through vscode-languageclient (stdio), mirroring settings into
// initializationOptions (restarting the server when they change), reporting the first inline
// item of each response as shown (codespec/didShowCompletion; acceptance is counted by the
// item's own command), the "codespec: Rewrite selection" command (codespec/edit, progress
// from codespec/editDelta, then the final TextEdits applied as one edit), and the status bar
// item (tokens/s and acceptance from codespec/status).
// Must not touch: completion logic — post-processing, debounce and the daemon live in the
// language server.

import * as vscode from 'vscode';
import {
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  State,
  TransportKind,
} from 'vscode-languageclient/node';
import { initializationOptions, serverCommand, statusText } from './options';

interface EditDelta {
  token: string;
  uri: string;
  text: string;
}

interface EditResult {
  token: string;
  text: string;
  edits: { range: unknown; newText: string }[];
  version: number | null;
}

let client: LanguageClient | undefined;
let statusItem: vscode.StatusBarItem;
let statusTimer: NodeJS.Timeout | undefined;
let editCounter = 0;
const editListeners = new Map<string, (delta: EditDelta) => void>();

function settings(): (key: string) => unknown {
  const cfg = vscode.workspace.getConfiguration('codespec');
  return (key: string) => cfg.get(key);
}

function itemId(item: vscode.InlineCompletionItem | undefined): string | undefined {
  const args = item?.command?.arguments;
  return args && args.length > 0 ? String(args[0]) : undefined;
}

async function startClient(context: vscode.ExtensionContext): Promise<void> {
  const { command, args } = serverCommand(settings());
  const serverOptions: ServerOptions = { command, args, transport: TransportKind.stdio };
  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }],
    initializationOptions: initializationOptions(settings()),
    middleware: {
      provideInlineCompletionItems: async (document, position, ctx, token, next) => {
        const result = await next(document, position, ctx, token);
        const items = Array.isArray(result) ? result : result?.items;
        const id = itemId(items?.[0]);
        if (id && client) {
          void client.sendNotification('codespec/didShowCompletion', { id });
        }
        return result;
      },
    },
  };
  client = new LanguageClient('codespec', 'codespec', serverOptions, clientOptions);
  context.subscriptions.push(
    client.onNotification('codespec/editDelta', (delta: EditDelta) => {
      editListeners.get(delta.token)?.(delta);
    }),
  );
  await client.start();
}

async function stopClient(): Promise<void> {
  const c = client;
  client = undefined;
  if (c && c.state !== State.Stopped) {
    await c.stop();
  }
}

async function refreshStatus(): Promise<void> {
  if (!client || client.state !== State.Running) {
    statusItem.text = '$(circle-slash) codespec';
    return;
  }
  try {
    const st = await client.sendRequest<any>('codespec/status', {});
    statusItem.text = statusText(st);
    const lines = [
      `daemon: ${st.socket}`,
      `model: ${st.daemonStats?.model ?? '?'} on ${st.daemonStats?.device ?? '?'}`,
      `shown ${st.completions.shown}, accepted ${st.completions.accepted}`,
    ];
    for (const [name, p] of Object.entries<any>(st.completions.per_proposer ?? {})) {
      lines.push(`${name}: ${p.accepted} accepted items, ${p.draft_tokens} draft tokens`);
    }
    statusItem.tooltip = lines.join('\n');
  } catch {
    statusItem.text = '$(warning) codespec';
  }
}

async function rewriteSelection(): Promise<void> {
  const editor = vscode.window.activeTextEditor;
  if (!editor || !client) {
    return;
  }
  const document = editor.document;
  const selection = editor.selection.isEmpty
    ? document.lineAt(editor.selection.active.line).rangeIncludingLineBreak
    : new vscode.Range(editor.selection.start, editor.selection.end);
  const instruction = await vscode.window.showInputBox({
    prompt: 'codespec: how should the selection change? (empty: let the model decide)',
  });
  if (instruction === undefined) {
    return;
  }
  const version = document.version;
  const token = `vscode-${process.pid}-${++editCounter}`;
  const c = client;
  await vscode.window.withProgress(
    {
      location: vscode.ProgressLocation.Notification,
      title: 'codespec: rewriting',
      cancellable: true,
    },
    async (progress, cancel) => {
      let streamed = '';
      editListeners.set(token, (delta) => {
        streamed += delta.text;
        const last = streamed.trimEnd().split('\n').pop() ?? '';
        progress.report({ message: `${streamed.length} chars · ${last.slice(-60)}` });
      });
      try {
        const result = await c.sendRequest<EditResult>(
          'codespec/edit',
          {
            textDocument: { uri: document.uri.toString(), version },
            range: c.code2ProtocolConverter.asRange(selection),
            instruction: instruction || undefined,
            token,
          },
          cancel,
        );
        if (document.version !== version) {
          void vscode.window.showWarningMessage(
            'codespec: the document changed during the rewrite; nothing was applied',
          );
          return;
        }
        const edit = new vscode.WorkspaceEdit();
        const edits = await c.protocol2CodeConverter.asTextEdits(result.edits as any);
        edit.set(document.uri, edits ?? []);
        await vscode.workspace.applyEdit(edit);
      } catch (err: any) {
        if (!cancel.isCancellationRequested) {
          void vscode.window.showErrorMessage(`codespec: rewrite failed: ${err?.message ?? err}`);
        }
      } finally {
        editListeners.delete(token);
      }
    },
  );
}

async function showStatus(): Promise<void> {
  if (!client) {
    void vscode.window.showWarningMessage('codespec: the language server is not running');
    return;
  }
  const st = await client.sendRequest<any>('codespec/status', {});
  const doc = await vscode.workspace.openTextDocument({
    language: 'json',
    content: JSON.stringify(st, null, 2),
  });
  await vscode.window.showTextDocument(doc, { preview: true });
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  statusItem = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
  statusItem.command = 'codespec.showStatus';
  statusItem.text = '$(loading~spin) codespec';
  statusItem.show();
  context.subscriptions.push(
    statusItem,
    vscode.commands.registerCommand('codespec.rewriteSelection', rewriteSelection),
    vscode.commands.registerCommand('codespec.showStatus', showStatus),
    vscode.commands.registerCommand('codespec.restart', async () => {
      await stopClient();
      await startClient(context);
    }),
    vscode.workspace.onDidChangeConfiguration(async (e) => {
      if (e.affectsConfiguration('codespec')) {
        await stopClient(); // initialization options are only read at start
        await startClient(context);
      }
    }),
  );
  statusTimer = setInterval(() => void refreshStatus(), 5000);
  await startClient(context);
}

export async function deactivate(): Promise<void> {
  if (statusTimer) {
    clearInterval(statusTimer);
  }
  await stopClient();
}
