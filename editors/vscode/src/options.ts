// codespec VS Code extension: settings → the language server's initializationOptions.
//
// Owns: the mapping of `codespec.*` settings to the camelCase map `codespec lsp` parses
// (see lsp/options.py). No `vscode` import, so the node tests use it as it is.

export type Settings = (key: string) => unknown;

/** Setting name (after `codespec.`) → initialization option name. */
export const OPTION_KEYS: Record<string, string> = {
  socket: 'socket',
  autostartDaemon: 'autostartDaemon',
  maxTokens: 'maxTokens',
  temperature: 'temperature',
  multiline: 'multiline',
  invokedItems: 'invokedItems',
  debounceMs: 'debounceMs',
  speculation: 'speculation',
};

/** The initializationOptions for the current settings; unset (undefined/null) ones are left out. */
export function initializationOptions(get: Settings): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [setting, option] of Object.entries(OPTION_KEYS)) {
    const value = get(setting);
    if (value !== undefined && value !== null) {
      out[option] = value;
    }
  }
  return out;
}

/** The server command from the `codespec.command` setting (a list, e.g. ["codespec", "lsp"]). */
export function serverCommand(get: Settings): { command: string; args: string[] } {
  const raw = get('command');
  const cmd = Array.isArray(raw) && raw.length > 0 ? raw.map(String) : ['codespec', 'lsp'];
  return { command: cmd[0], args: cmd.slice(1) };
}

export interface CompletionCounters {
  shown: number;
  accepted: number;
  acceptance_rate: number;
  tokens_per_s: number;
}

/** Status bar text from a `codespec/status` result. */
export function statusText(status: { connected: boolean; completions: CompletionCounters }): string {
  if (!status.connected) {
    return '$(circle-slash) codespec';
  }
  const c = status.completions;
  const rate = c.shown > 0 ? ` · ${Math.round(100 * c.acceptance_rate)}% accepted` : '';
  return `$(sparkle) codespec ${c.tokens_per_s.toFixed(0)} tok/s${rate}`;
}
