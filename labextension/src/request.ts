/* eslint-disable @typescript-eslint/no-explicit-any -- the one place raw JSON enters (see model.ts) */
import { URLExt } from '@jupyterlab/coreutils';

import { ServerConnection } from '@jupyterlab/services';

/** The server extension's API namespace: `{base_url}/autogpu/`. */
export const NAMESPACE = 'autogpu';

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
  const requestUrl = URLExt.join(serverSettings.baseUrl, NAMESPACE, endPoint);

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
    throw new ServerConnection.ResponseError(response, data.message || data);
  }

  return data;
}
