/* eslint-disable @typescript-eslint/no-explicit-any -- the one place raw JSON enters (see model.ts) */
import { URLExt } from '@jupyterlab/coreutils';

import { ServerConnection } from '@jupyterlab/services';

/** The server extension's namespace: `{base_url}/autogpu/`. */
export const NAMESPACE = 'autogpu';

/**
 * The version of the server extension's REST API this sidebar speaks: `{base_url}/autogpu/api/v1/`.
 * (The unversioned paths of 0.1, `{base_url}/autogpu/devices` ..., are deprecated: CHANGELOG.md.)
 */
export const API_PATH = 'api/v1';

/**
 * What the sidebar says when the server has no autogpu server extension: the lab extension is
 * installed (it was found on the data path) but the Jupyter server did not load its other half,
 * e.g. after `pip install --user` on JupyterHub, or with the extension disabled.
 */
export const MISSING_SERVER_EXTENSION =
  "autogpu's server extension is not running on this Jupyter server: install " +
  'autogpu-jupyter[lab] where the server runs (or `jupyter server extension enable ' +
  'autogpu_jupyter` there) and restart it';

/** The URL of an API end point: the one place the sidebar builds its URLs. */
export function apiUrl(baseUrl: string, endPoint: string): string {
  return URLExt.join(baseUrl, NAMESPACE, API_PATH, endPoint);
}

/**
 * Call the server extension.
 *
 * @param endPoint API REST end point for the extension, e.g. `devices` or `history?since=1`
 * @param serverSettings The server settings to use for the request
 * @param init Initial values for the request
 * @returns The response body interpreted as JSON (validate it before use: see model.ts)
 */
export async function requestAPI<T>(
  endPoint: string,
  serverSettings: ServerConnection.ISettings,
  init: RequestInit = {}
): Promise<T> {
  const requestUrl = apiUrl(serverSettings.baseUrl, endPoint);

  let response: Response;
  try {
    response = await ServerConnection.makeRequest(
      requestUrl,
      init,
      serverSettings
    );
  } catch (error) {
    throw new ServerConnection.NetworkError(error as any);
  }

  let data: any = await response.text();

  if (data.length > 0) {
    try {
      data = JSON.parse(data);
    } catch (error) {
      // not JSON (a proxy's HTML error page, for instance): keep the text for the message
    }
  }

  if (!response.ok) {
    // Our handlers answer their own 404s (an unknown kernel) with a JSON message; a 404 without
    // one is the server's: no handler is registered under our path.
    const ours = data !== null && typeof data === 'object' && 'message' in data;
    if (response.status === 404 && !ours) {
      throw new ServerConnection.ResponseError(
        response,
        MISSING_SERVER_EXTENSION
      );
    }
    throw new ServerConnection.ResponseError(response, data.message || data);
  }

  return data;
}
